"""Payloads, sampling, state stores and the ledger."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from fedhet.algorithms.base import ClientModule
from fedhet.core.payloads import ClassStatsPayload, WeightsPayload
from fedhet.errors import CheckpointError, ConfigError, TrainingError
from fedhet.federation.ledger import CommunicationLedger
from fedhet.federation.sampling import clients_per_round, sample_clients
from fedhet.federation.state import DiskStateStore, MemoryStateStore
from fedhet.models import create_model


def test_payload_nbytes_is_measured():
    """Payload sizes are the tensors' bytes; class statistics count only the classes held."""
    p = WeightsPayload(weights={"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.float64)}, num_examples=7)
    assert p.nbytes() == 3 * 4 * 4 + 5 * 8
    stats = ClassStatsPayload(values=torch.zeros(10, 64), counts=torch.tensor([3, 0, 1, 0, 0, 0, 0, 0, 0, 2]))
    assert stats.nbytes() == 3 * (64 * 4 + 8)  # only the 3 classes held go on the wire


def test_payload_validation_rejects_nan_and_shape():
    """Validation rejects NaN, shapes and keys that differ from the reference."""
    bad = WeightsPayload(weights={"a": torch.tensor([1.0, float("nan")])})
    with pytest.raises(TrainingError, match="non-finite"):
        bad.validate("client 3")
    good = WeightsPayload(weights={"a": torch.zeros(2)})
    with pytest.raises(TrainingError, match="shape"):
        good.validate_against({"a": torch.zeros(3)}, "client 1")
    with pytest.raises(TrainingError, match="keys"):
        good.validate_against({"b": torch.zeros(2)}, "client 1")
    stats = ClassStatsPayload(values=torch.zeros(4, 2), counts=torch.zeros(4, dtype=torch.long))
    with pytest.raises(TrainingError, match="shape"):
        stats.validate_shape(num_classes=10, dim=2)


def test_payload_screening_names_the_field_and_reads_float64_in_float64():
    """Non-finite values are named by field (inf as NaN); a float64 value past float32's range is finite, not NaN."""
    payload = WeightsPayload(weights={"a": torch.zeros(2), "b": torch.tensor([1.0, -float("inf")])})
    with pytest.raises(TrainingError, match="client 2 sent non-finite values in 'weights.b'"):
        payload.validate("client 2")
    huge = WeightsPayload(weights={"a": torch.tensor([1e300, -2.0], dtype=torch.float64)})
    huge.validate("client 1")  # finite in its own dtype
    assert huge.largest_magnitude() == 1e300
    with pytest.raises(TrainingError, match="client 1 sent a value of magnitude 1e\\+300 \\(bound 1e\\+06\\)"):
        huge.check_value_bound(1e6, "client 1")
    assert WeightsPayload(weights={"n": torch.tensor([3, -7])}).largest_magnitude() == 0.0  # integers carry none


def test_on_device_moves_only_a_module_that_is_elsewhere():
    """A module whose parameters are already on the device is returned without Module.to's walk."""
    from fedhet.federation.trainer import on_device

    module = torch.nn.Linear(2, 2)
    calls = []
    original = module.to
    module.to = lambda *args, **kwargs: calls.append(args) or original(*args, **kwargs)  # type: ignore[method-assign]
    assert on_device(module, torch.device("cpu")) is module and calls == []
    assert on_device(module, torch.device("meta")) is module and calls == [(torch.device("meta"),)]
    assert module.weight.device.type == "meta"


def test_sampling_fraction_count_and_determinism():
    """Participation as a fraction or a count; the sample is sorted, seeded per round and validated."""
    assert clients_per_round(20, 1.0) == 20
    assert clients_per_round(20, 0.5) == 10
    assert clients_per_round(20, 3) == 3
    a = sample_clients(20, 0.5, seed=1, round_idx=4)
    assert a == sample_clients(20, 0.5, seed=1, round_idx=4) and len(a) == 10 and a == sorted(a)
    assert a != sample_clients(20, 0.5, seed=1, round_idx=5)
    with pytest.raises(ConfigError):
        clients_per_round(5, 6)
    with pytest.raises(ConfigError):
        clients_per_round(5, 1.5)


def _state(v):
    return {"module": {"w": torch.full((2,), float(v))}, "optimizer": None}


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_state_store_commit_and_restore(kind, tmp_path):
    """Staged states become visible on commit; a restore drops a round that never committed."""
    store = MemoryStateStore() if kind == "memory" else DiskStateStore(tmp_path)
    assert store.get(0) is None
    store.put(0, 0, _state(1))
    assert store.get(0) is None  # staged, not committed
    store.commit(0)
    checkpoint = store.checkpoint_state()
    store.prune()
    store.put(0, 1, _state(2))  # a round that never commits (killed)
    fresh = MemoryStateStore() if kind == "memory" else DiskStateStore(tmp_path)
    fresh.restore(checkpoint)
    assert torch.equal(fresh.get(0)["module"]["w"], torch.full((2,), 1.0))
    if kind == "disk":
        assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["client_0_r0.pt"]


def test_disk_store_corrupt_file_is_a_clear_error(tmp_path):
    """A corrupt client state file raises a CheckpointError that says so."""
    store = DiskStateStore(tmp_path)
    store.put(3, 0, _state(1))
    store.commit(0)
    (tmp_path / "client_3_r0.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="corrupt"):
        store.get(3)


def test_ledger_totals():
    """The ledger reports per-round, per-client and running totals of bytes up and down."""
    ledger = CommunicationLedger()
    ledger.start_round()
    ledger.record_up(100)
    ledger.record_down(30)
    ledger.record_down(30)
    m = ledger.end_round(0, participants=2)
    assert m["comm/bytes_up"] == 100 and m["comm/bytes_down_per_client"] == 30
    ledger.start_round()
    ledger.record_up(1)
    assert ledger.end_round(1, 1)["comm/bytes_up_total"] == 101


@pytest.mark.parametrize(("accelerator", "expected"), [("gpu", "cuda:0"), ("cuda", "cuda:0"), ("mps", "mps:0"),
                                                       ("cpu", "cpu")])
def test_trainer_device_carries_the_accelerator_index(accelerator, expected):
    """Lightning's CUDA setup (``torch.cuda.set_device``) refuses a bare ``cuda`` device: every fit failed on a GPU."""
    from fedhet.federation.trainer import ServerTrainerTemplate, TrainerTemplate

    assert str(TrainerTemplate(accelerator=accelerator).device()) == expected
    assert str(ServerTrainerTemplate(accelerator=accelerator).device()) == expected
    if accelerator != "cpu":
        from fedhet.federation.trainer import ResidentDeviceStrategy

        strategy = TrainerTemplate(accelerator=accelerator).trainer_kwargs()["strategy"]
        assert isinstance(strategy, ResidentDeviceStrategy)
        assert strategy.root_device.index == 0


def test_gpu_fits_keep_the_allocator_cache_and_client_modules_stay_on_the_device():
    """GPU fits keep PyTorch's allocator cache, and client modules stay on the device after a fit.

    Lightning emptied the CUDA cache around every fit (each client's first steps paid a cudaMalloc
    per buffer) and moved every client module back to the CPU: fedhet's sequential round took 2x
    a plain loop's on an H200. Server stages still return to the CPU.
    """
    from unittest import mock

    from fedhet.federation.trainer import CachingCUDAAccelerator, ServerTrainerTemplate, TrainerTemplate

    client_kwargs = TrainerTemplate(accelerator="gpu").trainer_kwargs()
    server_kwargs = ServerTrainerTemplate(accelerator="gpu")._template.trainer_kwargs()
    assert isinstance(client_kwargs["accelerator"], CachingCUDAAccelerator)
    assert isinstance(server_kwargs["accelerator"], CachingCUDAAccelerator)
    assert TrainerTemplate(accelerator="cpu").trainer_kwargs()["accelerator"] == "cpu"

    trainer = mock.Mock(local_rank=0)
    with mock.patch("torch.cuda.empty_cache") as empty_cache:
        CachingCUDAAccelerator().setup(trainer)
        CachingCUDAAccelerator().teardown()
    empty_cache.assert_not_called()

    for kwargs, returns_to_cpu in ((client_kwargs, False), (server_kwargs, True)):
        strategy = kwargs["strategy"]
        strategy.accelerator = kwargs["accelerator"]
        module = mock.Mock(spec=torch.nn.Module)
        strategy._lightning_module = module
        strategy.teardown()
        assert module.cpu.called is returns_to_cpu


def test_memory_format_lays_out_client_modules_and_every_fit():
    """``channels_last``: runtime-built client modules and any module a template fits get NHWC weights.

    The layout is applied when a client module is built (so its evaluation uses the same kernels
    in every worker) and again by the strategy (server stages); optimizers keep training the
    module's own parameters, and the default leaves weights contiguous.
    """
    from fedhet.federation.trainer import ServerTrainerTemplate, TrainerTemplate, silence_lightning

    silence_lightning()
    torch.manual_seed(0)
    module = ClientModule(create_model("cnn_tiny", num_classes=4, in_channels=3), 4, lr=0.1)
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    loader = DataLoader(TensorDataset(torch.randn(8, 3, 16, 16), torch.randint(0, 4, (8,))), batch_size=4)
    server_trainer = ServerTrainerTemplate(accelerator="cpu", memory_format="channels_last")
    server_trainer.build(epochs=1, steps=None).fit(module, loader)
    convolutions = {name: p for name, p in module.named_parameters() if p.dim() == 4}
    assert convolutions and all(p.is_contiguous(memory_format=torch.channels_last) for p in convolutions.values())
    assert all(not torch.equal(p, before[name]) for name, p in convolutions.items())  # the optimizer stepped them

    default = ClientModule(create_model("cnn_tiny", num_classes=4, in_channels=3), 4, lr=0.1)
    TrainerTemplate(max_epochs=1, accelerator="cpu").build().fit(default, loader)
    assert all(p.is_contiguous() for p in default.parameters())
