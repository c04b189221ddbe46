"""The shared servers and client parts of ``fedhet/algorithms/shared/common.py``, each checked with numbers.

Most methods are built from these parts, and the registry-wide tests run them all; these pin what
the parts do on their own with hand-computed values: the virtual global model's per-architecture
averages, the weight-averaging server's groups, checks, weighting and downloads, the class-mean
server's declared width, checks and weighted means, the per-parameter buffers, and the prototype
server's checks and bookkeeping.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedhet.algorithms.base import ClientStates, ClientUpload, ServerContext
from fedhet.algorithms.shared.common import (
    SHARED,
    AveragedClientModels,
    ClassMeanServer,
    FedAvgClient,
    ParameterBuffers,
    PrototypeTrainingServer,
    SubmoduleAveragingServer,
)
from fedhet.core.payloads import ClassStatsPayload, WeightsPayload
from fedhet.errors import ConfigError, TrainingError
from tests.algorithms.helpers import context, upload


class _Pair(nn.Module):
    """A parameter ``w`` of two entries and a buffer ``b`` (BatchNorm-like state that is averaged too)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2))
        self.register_buffer("b", torch.zeros(1))


def _state(w: list[float], b: float, extra: float = 0.0) -> dict[str, torch.Tensor]:
    """A client module's state: the backbone under ``model.``, and a part outside it."""
    return {"model.w": torch.tensor(w), "model.b": torch.tensor([b]), "aux.v": torch.tensor([extra])}


def test_the_virtual_global_model_averages_each_architecture_by_examples_and_builds_once():
    """Clients 0, 1 ('a', 1 and 3 examples) and 2 ('b'): per architecture ``sum n_i w_i / sum n_i`` of ``model.``."""
    states = {0: _state([1.0, 2.0], 4.0), 1: _state([5.0, 6.0], 8.0, extra=9.0), 2: _state([7.0, 7.0], 1.0)}
    examples = {0: 1, 1: 3, 2: 2}
    built = []

    def build(architecture: str) -> nn.Module:
        built.append(architecture)
        return _Pair()

    average = AveragedClientModels()
    clients = ClientStates(("a", "a", "b"), states.__getitem__, examples.__getitem__, build)
    models = average(clients)
    assert sorted(models) == ["virtual_global_a", "virtual_global_b"]
    a = models["virtual_global_a"].state_dict()
    assert torch.equal(a["w"], torch.tensor([4.0, 5.0])) and torch.equal(a["b"], torch.tensor([7.0]))  # (1x + 3y) / 4
    b = models["virtual_global_b"].state_dict()
    assert torch.equal(b["w"], torch.tensor([7.0, 7.0])) and torch.equal(b["b"], torch.tensor([1.0]))
    states[1] = _state([1.0, 2.0], 4.0)  # the next call reads the states as stored then, into the same networks
    again = average(clients)
    assert built == ["a", "b"] and again["virtual_global_a"] is models["virtual_global_a"]
    assert torch.equal(again["virtual_global_a"].state_dict()["w"], torch.tensor([1.0, 2.0]))
    one = AveragedClientModels()(ClientStates(("a", "a"), states.__getitem__, examples.__getitem__, build))
    assert list(one) == ["virtual_global"]  # one architecture: no suffix


def _context(architectures: tuple[str, ...], states: dict[int, dict[str, torch.Tensor]], **fields) -> ServerContext:
    """Two classes, seed 3, client ``i`` of ``architectures[i]`` starting from ``states[i]``."""
    return context(initial=states.__getitem__, seed=3, architectures=architectures, **fields)


def _weights(cid: int, architecture: str, w: list[float], n: int, **tensors: torch.Tensor) -> ClientUpload:
    weights = {"w": torch.tensor(w), "b": torch.tensor([0.0]), **tensors}
    return ClientUpload(cid, architecture, WeightsPayload(num_examples=n, weights=weights))


def test_the_averaging_server_keeps_one_global_submodule_per_group_and_weights_by_examples():
    """Per architecture (or shared): the first client's initial sub-module, then example- or uniform-weighted means."""
    states = {0: _state([1.0, 1.0], 0.0), 1: _state([2.0, 2.0], 0.0), 2: _state([3.0, 3.0], 0.0)}
    server = SubmoduleAveragingServer()
    server.setup_server(_context(("a", "a", "b"), states))
    assert {k: v["w"].tolist() for k, v in server.global_by_architecture.items()} == {"a": [1.0, 1.0], "b": [3.0, 3.0]}
    assert server.group_sizes() == {"a": 2, "b": 1} and server.supports_aggregator()
    assert server.download_for(1).weights["w"].tolist() == [1.0, 1.0]  # send_initial: the common start
    server.aggregate(0, [_weights(0, "a", [1.0, 0.0], 1), _weights(1, "a", [5.0, 4.0], 3)])
    assert server.weights_for(0)["w"].tolist() == [4.0, 3.0] and server.aggregated == {"a"}  # (1x + 3y) / 4
    assert server.weights_for(2)["w"].tolist() == [3.0, 3.0]  # 'b' sent nothing: unchanged

    uniform = SubmoduleAveragingServer(weighting="uniform", per_architecture=False, send_initial=False)
    uniform.setup_server(_context(("a", "a", "b"), states))
    assert list(uniform.global_by_architecture) == [SHARED] and uniform.group_sizes() == {SHARED: 3}
    assert uniform.download_for(2) is None  # nothing aggregated yet: clients keep their own
    uniform.aggregate(0, [_weights(0, "a", [1.0, 0.0], 1), _weights(2, "b", [5.0, 4.0], 3)])
    assert uniform.download_for(2).weights["w"].tolist() == [3.0, 2.0]  # (x + y) / 2

    ruled = SubmoduleAveragingServer()
    ruled.setup_server(_context(("a",), states, aggregate_states=lambda members, weights: dict(members[-1])))
    ruled.aggregate(0, [_weights(0, "a", [1.0, 0.0], 1), _weights(0, "a", [9.0, 9.0], 1)])
    assert ruled.global_weights["w"].tolist() == [9.0, 9.0]  # federation.aggregator's rule replaces the mean

    class Own(SubmoduleAveragingServer):
        def aggregate(self, round_idx, uploads):
            pass

    assert not Own().supports_aggregator()


def test_the_averaging_server_refuses_uploads_unlike_the_global_submodule_naming_the_sender():
    """Architecture, keys, shapes, exact dtype and payload type, each against the server's own global sub-module."""
    states = {0: _state([1.0, 1.0], 0.0)}
    server = SubmoduleAveragingServer()
    server.setup_server(_context(("a",), states))
    server.check_upload(_weights(0, "a", [1.0, 2.0], 1))  # the global model's layout: accepted
    cases = [
        (_weights(0, "z", [1.0, 2.0], 1), r"^client 0 sent weights of architecture 'z', unknown to the server$"),
        (_weights(0, "a", [1.0, 2.0], 1, v=torch.ones(1)), r"^client 0 sent weights whose keys differ .*'v'"),
        (_weights(0, "a", [1.0, 2.0, 3.0], 1), r"^client 0 sent 'weights.w' of shape \(3,\), expected \(2,\)"),
        (ClientUpload(0, "a", WeightsPayload(num_examples=1, weights={"w": torch.tensor([1, 2]), "b": torch.zeros(1)})),
         r"^client 0 sent 'weights.w' as torch.int64 where the global model holds torch.float32"),
        (ClientUpload(0, "a", ClassStatsPayload(num_examples=1)), r"^client 0 sent ClassStatsPayload, expected model"),
    ]
    for sent, message in cases:
        with pytest.raises(TrainingError, match=message):
            server.check_upload(sent)


def test_the_averaging_server_restores_its_state_and_builds_evaluation_models_once():
    """State round trip with the aggregated groups; evaluation models of whole models only, built once."""
    states = {0: _state([1.0, 1.0], 0.0), 1: _state([3.0, 3.0], 2.0)}
    built = []

    def factory(architecture: str, seed: int) -> nn.Module:
        built.append((architecture, seed))
        return _Pair()

    server = SubmoduleAveragingServer(per_architecture=False)
    server.setup_server(_context(("a", "b"), states, model_factory=factory))
    server.aggregate(0, [_weights(0, "a", [2.0, 4.0], 1)])
    models = server.server_models()
    assert built == [("a", 3)] and list(models) == [SHARED]  # one shared model, the first architecture's network
    assert models[SHARED].state_dict()["w"].tolist() == [2.0, 4.0]
    server.aggregate(1, [_weights(1, "b", [6.0, 8.0], 1)])
    assert server.server_models()[SHARED] is models[SHARED] and built == [("a", 3)]
    assert models[SHARED].state_dict()["w"].tolist() == [6.0, 8.0]

    restored = SubmoduleAveragingServer(per_architecture=False, send_initial=False)
    restored.load_server_state(server.server_state())
    assert restored.aggregated == {SHARED} and restored.global_weights["w"].tolist() == [6.0, 8.0]
    head_only = SubmoduleAveragingServer(prefix="model.head.")
    head_only.setup_server(_context(("a",), states, model_factory=factory))
    assert head_only.server_models() == {}  # a part of the model is no model to evaluate
    no_factory = SubmoduleAveragingServer()
    no_factory.setup_server(_context(("a",), states))
    assert no_factory.server_models() == {}


def test_zeros_per_group_mirror_the_client_state_under_a_prefix_or_name_the_missing_clients():
    """FedDyn's ``h`` / SCAFFOLD's ``c``: zeros per group, shaped like the first client's ``<prefix>.`` entries."""
    states = {0: {"c.w": torch.ones(2), "model.w": torch.ones(2)}, 1: {"c.w": torch.ones(3)}, 2: {"c.w": torch.ones(2)}}
    server = SubmoduleAveragingServer()
    server.setup_server(_context(("a", "b", "a"), states))
    zeros = server.zeros_per_group(_context(("a", "b", "a"), states), "c", "SCAFFOLD")
    assert {k: v["w"].tolist() for k, v in zeros.items()} == {"a": [0.0, 0.0], "b": [0.0, 0.0, 0.0]}
    with pytest.raises(ConfigError, match=r"^FedDyn's server needs FedDyn clients \(no 'h' in the client state\)$"):
        server.zeros_per_group(_context(("a", "b", "a"), states), "h", "FedDyn")


def _stats(cid: int, values: list[list[float]], counts: list[int], dtype=torch.float32) -> ClientUpload:
    return upload(cid, ClassStatsPayload(values=torch.tensor(values, dtype=dtype), counts=torch.tensor(counts)))


def test_the_class_mean_server_declares_its_width_and_averages_held_classes():
    """Width from a number, the class count or the head's input; means weighted by counts (FedProto Eq. 6) or not."""
    head = {"model.head.weight": torch.zeros(2, 3)}
    for dim, width in ((5, 5), ("classes", 2), ("features", 3)):
        server = ClassMeanServer(dim=dim)
        server.setup_server(_context(("x",), {0: head}))
        assert (server.num_classes, server.dim) == (2, width)
    headless = ClassMeanServer()
    headless.setup_server(_context(("x",), {0: {"model.w": torch.zeros(2)}}))
    assert headless.dim is None and headless.download_for(0) is None and headless.server_state() == {}

    server = ClassMeanServer(dim=2)
    server.setup_server(_context(("x", "x"), {0: head, 1: head}))
    server.aggregate(0, [])  # nothing arrived: nothing changes
    assert server.download_for(0) is None
    server.aggregate(0, [_stats(0, [[1.0, 2.0], [0.0, 0.0]], [1, 0]), _stats(1, [[5.0, 6.0], [3.0, 3.0]], [3, 2])])
    sent = server.download_for(1)
    assert sent.values.tolist() == [[4.0, 5.0], [3.0, 3.0]] and sent.counts.tolist() == [1, 1]  # (1x + 3y) / 4
    restored = ClassMeanServer(dim=2)
    restored.load_server_state(server.server_state())
    assert restored.download_for(0).values.tolist() == [[4.0, 5.0], [3.0, 3.0]]

    uniform = ClassMeanServer(weighting="uniform", dim=2)
    uniform.setup_server(_context(("x", "x"), {0: head, 1: head}))
    uniform.aggregate(0, [_stats(0, [[1.0, 2.0], [0.0, 0.0]], [1, 0]), _stats(1, [[5.0, 6.0], [3.0, 3.0]], [3, 2])])
    assert uniform.download_for(0).values.tolist() == [[3.0, 4.0], [3.0, 3.0]]  # held classes: plain means


def test_the_class_mean_server_checks_uploads_against_its_declared_width_and_the_clients_counts():
    """Width, dtype, counts within what the client holds; without a declared width, the first means' width."""
    held = torch.tensor([[2, 0], [5, 5]])
    server = ClassMeanServer(dim=2)
    server.setup_server(_context(("x", "x"), {0: {}, 1: {}}, label_counts=held))
    server.check_upload(_stats(0, [[1.0, 2.0], [0.0, 0.0]], [2, 0]))
    cases = [
        (_stats(0, [[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], [2, 0]), r"^client 0 sent 'values' of shape \(2, 3\), expected"),
        (_stats(0, [[1.0, 2.0], [0.0, 0.0]], [2, 0], torch.float64), r"^client 0 sent 'values' as torch.float64"),
        (_stats(0, [[1.0, 2.0], [0.0, 0.0]], [3, 0]), r"^client 0 sent .*class counts"),  # above what client 0 holds
        (upload(0, WeightsPayload(num_examples=1)), r"^client 0 sent WeightsPayload, expected class stat"),
    ]
    for sent, message in cases:
        with pytest.raises(TrainingError, match=message):
            server.check_upload(sent)
    server.check_upload(_stats(1, [[1.0, 2.0], [0.0, 0.0]], [3, 0]))  # client 1 holds 5 of class 0

    undeclared = ClassMeanServer(dim="features")  # a model without a linear head: uploads must agree
    undeclared.setup_server(_context(("x", "x"), {0: {}, 1: {}}))
    undeclared.check_upload(_stats(0, [[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], [1, 0]))  # any width before a mean
    with pytest.raises(TrainingError, match=r"^client 1 sent 'values' of shape \(2, 2\), expected \(2, 3\)"):
        undeclared.aggregate(0, [_stats(0, [[1.0, 2.0, 3.0], [0.0] * 3], [1, 0]),
                                 _stats(1, [[1.0, 2.0], [0.0] * 2], [1, 0])])
    undeclared.aggregate(0, [_stats(0, [[1.0, 2.0, 3.0], [0.0] * 3], [1, 0])])
    with pytest.raises(TrainingError, match=r"expected \(2, 3\)"):  # then the global means' width
        undeclared.check_upload(_stats(1, [[1.0, 2.0], [0.0, 0.0]], [1, 0]))


def test_parameter_buffers_mirror_every_parameter_as_zeros_under_its_own_path():
    """Nested paths become sub-modules; the buffers are zeros without gradients, in parameter order, live."""
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1, bias=False))
    buffers = ParameterBuffers(model)
    assert buffers.names == ("0.weight", "0.bias", "2.weight")
    assert list(buffers.state_dict()) == ["0.weight", "0.bias", "2.weight"]
    assert [tuple(t.shape) for t in buffers.tensors()] == [(3, 2), (3,), (1, 3)]
    assert all(not t.requires_grad and not t.any() for t in buffers.tensors()) and not list(buffers.parameters())
    buffers.as_dict()["0.bias"].fill_(2.0)  # the live tensors, not copies
    assert buffers.get_buffer("0.bias").tolist() == [2.0, 2.0, 2.0]


class _Prototypes(PrototypeTrainingServer):
    """The smallest prototype server: a linear map trained to send each prototype to its class."""

    def build(self, context, initial_head):
        self.map = nn.Linear(self.feature_dim, self.num_classes)

    def prototype_loss(self, prototypes, labels):
        return nn.functional.cross_entropy(self.map(prototypes), labels)


def test_the_prototype_server_checks_uploads_and_reports_its_mean_loss():
    """Declared defaults and overrides, the head's width, upload checks, empty rounds and the mean server loss."""
    server = _Prototypes(server_lr=0.5)
    assert (server.hp.server_lr, server.hp.server_epochs, server.hp.server_batch_size) == (0.5, 100, 10)
    with pytest.raises(ConfigError, match=r"^_Prototypes needs client models with a linear 'head'"):
        server.setup_server(_context(("x",), {0: {"model.w": torch.zeros(1)}}))
    held = torch.tensor([[1, 1], [0, 4]])
    server.setup_server(_context(("x", "x"), {0: {"model.head.weight": torch.zeros(2, 3)}}, label_counts=held))
    assert (server.num_classes, server.feature_dim) == (2, 3) and server.metrics() == {}
    server.check_upload(_stats(1, [[0.0] * 3, [1.0] * 3], [0, 4]))
    for sent, message in [(_stats(0, [[0.0] * 2, [1.0] * 2], [1, 1]), r"^client 0 sent 'values' of shape \(2, 2\)"),
                            (_stats(0, [[0.0] * 3, [1.0] * 3], [1, 2]), r"^client 0 sent .*class counts"),
                            (upload(0, WeightsPayload()), r"^client 0 sent WeightsPayload, expected class")]:
        with pytest.raises(TrainingError, match=message):
            server.check_upload(sent)
    server.aggregate(0, [])
    assert tuple(server.round_prototypes.shape) == (0, 3) and server.round_labels.dtype == torch.long
    (optimizer,) = [server.configure_optimizers()]
    assert type(optimizer) is torch.optim.SGD and optimizer.param_groups[0]["lr"] == 0.5
    assert optimizer.param_groups[0]["momentum"] == 0.0
    server.on_train_epoch_start()
    prototypes, labels = torch.tensor([[1.0, 0.0, 0.0]]), torch.tensor([1])
    first = server.training_step((prototypes, labels), 0)
    second = server.training_step((prototypes, labels), 1)
    assert server.metrics() == pytest.approx({"loss": (first.item() + second.item()) / 2})
    server.on_train_epoch_start()
    assert server.metrics() == {} and float(server.loss_sum) == 0.0


def test_a_shared_model_starts_from_a_seed_of_the_run_seed_its_purpose_and_its_name():
    """Every client builds the same shared model; another run seed, purpose or model gives another start."""
    from fedhet.algorithms.shared.common import build_shared_model
    from fedhet.models import create_model
    from fedhet.seeding import derive_seed

    def weights(model: nn.Module) -> torch.Tensor:
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    built = weights(build_shared_model("cnn_tiny", 10, 3, seed=4, purpose="meme"))
    assert torch.equal(built, weights(build_shared_model("cnn_tiny", 10, 3, seed=4, purpose="meme")))
    assert torch.equal(built, weights(create_model("cnn_tiny", num_classes=10, in_channels=3,
                                                   seed=derive_seed(4, "meme", "cnn_tiny"))))  # fmt: skip
    for other in (dict(seed=5, purpose="meme"), dict(seed=4, purpose="student")):
        assert not torch.equal(built, weights(build_shared_model("cnn_tiny", 10, 3, **other)))
    tiny = weights(create_model("mlp_tiny", num_classes=10, in_channels=3, seed=derive_seed(4, "meme", "mlp_tiny")))
    assert torch.equal(tiny, weights(build_shared_model("mlp_tiny", 10, 3, seed=4, purpose="meme")))


def test_epoch_shuffled_batches_cover_every_item_once_per_epoch_in_batches_with_a_short_last_one():
    """5 items, batches of 2, 3 epochs: 3 x [2, 2, 1] batches, each epoch a permutation; len 9."""
    from fedhet.algorithms.shared.common import EpochShuffledBatches

    sampler = EpochShuffledBatches(5, 2, 3)
    batches = list(sampler)
    assert len(sampler) == 9 and isinstance(len(sampler), int) and len(batches) == 9
    assert [len(b) for b in batches] == [2, 2, 1] * 3
    for epoch in range(3):
        assert sorted(i for b in batches[3 * epoch : 3 * epoch + 3] for i in b) == [0, 1, 2, 3, 4]


def test_a_fresh_server_holds_nothing_until_it_is_set_up():
    """Before ``setup_server``: no classes, width, counts or round data, no loss; the class-mean server's defaults."""
    means = ClassMeanServer()
    assert (means.num_classes, means.dim, means.label_counts) == (0, None, None)
    assert means.global_means is None and means.present is None
    assert means.dim_spec == "features" and means.weighting == "count"
    prototypes = _Prototypes()
    assert (prototypes.num_classes, prototypes.feature_dim, prototypes.label_counts) == (0, 0, None)
    assert tuple(prototypes.round_prototypes.shape) == (0, 0) and tuple(prototypes.round_labels.shape) == (0,)
    assert prototypes.round_labels.dtype == torch.long and prototypes.loss_steps == 0
    assert prototypes.loss_sum.shape == () and float(prototypes.loss_sum) == 0.0 and prototypes.metrics() == {}


def test_the_prototype_server_without_label_counts_checks_shape_and_dtype_only():
    """No counts known: any counts pass; float64 prototypes are refused; an empty round has no labels."""
    server = _Prototypes()
    server.setup_server(_context(("x",), {0: {"model.head.weight": torch.zeros(2, 3)}}))
    server.check_upload(_stats(0, [[0.0] * 3, [1.0] * 3], [100, 7]))
    with pytest.raises(TrainingError, match=r"^client 0 sent 'values' as torch.float64"):
        server.check_upload(_stats(0, [[0.0] * 3, [1.0] * 3], [1, 1], torch.float64))
    server.aggregate(0, [])
    assert tuple(server.round_labels.shape) == (0,)


def test_public_logits_are_checked_against_the_batch_and_class_count():
    """``[batch, classes]`` finite logits, or one line naming the sender (``client`` by default) and the field."""
    from fedhet.algorithms.shared.common import PublicLogitsPayload

    PublicLogitsPayload(logits=torch.zeros(2, 3)).validate_shape(2, 3)
    with pytest.raises(TrainingError, match=r"^client sent 'logits' of shape \(2, 3\), expected \(2, 2\)"):
        PublicLogitsPayload(logits=torch.zeros(2, 3)).validate_shape(2, 2)
    with pytest.raises(TrainingError, match=r"^client 4 sent 'logits' of shape \(1, 3\), expected \(2, 3\)"):
        PublicLogitsPayload(logits=torch.zeros(1, 3)).validate_shape(2, 3, "client 4")
    with pytest.raises(TrainingError, match=r"^client 4 .*non-finite"):
        PublicLogitsPayload(logits=torch.full((2, 3), float("nan"))).validate_shape(2, 3, "client 4")


def test_a_separately_clipped_client_clips_its_own_norm_then_lightnings():
    """One SGD step of lr 1: the update's norm is the per-model bound, then Lightning's tighter one if given."""
    import lightning.pytorch as pl

    from fedhet.algorithms.shared.common import SeparatelyClippedClient
    from fedhet.federation.trainer import silence_lightning
    from tests.algorithms.helpers import TinyLinear, one_batch_loader

    silence_lightning()
    x, y = torch.tensor([[3.0, 0.0]]), torch.tensor([1])  # CE on logits (3, 0): a gradient of norm well above 1

    def update_norm(max_grad_norm, **trainer):
        client = SeparatelyClippedClient(TinyLinear(), num_classes=2, lr=1.0, max_grad_norm=max_grad_norm)
        before = torch.cat([p.detach().flatten().clone() for p in client.parameters()])
        pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                   enable_checkpointing=False, **trainer).fit(client, one_batch_loader(x, y))  # fmt: skip
        return float((torch.cat([p.detach().flatten() for p in client.parameters()]) - before).norm())

    unclipped = update_norm(None)
    assert unclipped > 2.0
    assert update_norm(1.0) == pytest.approx(1.0, rel=1e-5)
    assert update_norm(1.0, gradient_clip_val=0.5) == pytest.approx(0.5, rel=1e-5)
    assert update_norm(None, gradient_clip_val=0.5) == pytest.approx(0.5, rel=1e-5)


def test_a_class_mean_client_uploads_int64_counts_and_needs_a_statistic():
    """FedProto's client: class means of the features with int64 counts; the abstract base names what is missing."""
    from fedhet.algorithms.shared.common import ClassMeanRegularizedClient, FedProtoClient
    from tests.algorithms.helpers import TinyLinear

    client = FedProtoClient(TinyLinear(), num_classes=3)
    assert client.global_means is None and client.global_present is None
    upload = client.make_upload([(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([0, 0])),
                                 (torch.tensor([[5.0, 6.0]]), torch.tensor([2]))])  # fmt: skip
    assert upload.counts.dtype == torch.long and upload.counts.tolist() == [2, 0, 1]
    assert upload.values.dtype == torch.float32 and upload.values.tolist() == [[2.0, 3.0], [0.0, 0.0], [5.0, 6.0]]
    with pytest.raises(NotImplementedError, match=r"^abstract: ClassMeanRegularizedClient must define statistic"):
        ClassMeanRegularizedClient(TinyLinear(), num_classes=2).statistic_and_logits(torch.zeros(1, 2))
    with pytest.raises(AssertionError, match="^a client without training data cannot upload class means$"):
        client.make_upload([])


def test_a_class_mean_client_pulls_only_toward_received_classes():
    """CE + lam * MSE(z, global[y]) over the samples whose class arrived; nothing received: CE alone."""
    from fedhet.algorithms.shared.common import FedProtoClient
    from tests.algorithms.helpers import TinyLinear

    x, y = torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 1])
    client = FedProtoClient(TinyLinear(), num_classes=2, lam=0.5)
    ce = nn.functional.cross_entropy(x, y)  # identity TinyLinear: features = logits = x
    assert client.local_loss((x, y)).item() == pytest.approx(ce.item())
    client.on_receive(ClassStatsPayload(values=torch.tensor([[3.0, 0.0], [9.0, 9.0]]), counts=torch.tensor([2, 0])))
    # only class 0 is present: MSE over sample 0's two features, ((1 - 3)^2 + 0^2) / 2 = 2
    assert client.local_loss((x, y)).item() == pytest.approx(ce.item() + 0.5 * 2.0)
    assert client.global_present.tolist() == [True, False]


def test_the_previous_model_teacher_is_frozen_and_retaken_when_its_choice_says():
    """The snapshot starts as the model, never trains, and is retaken at the end (previous_round) or start."""
    from fedhet.algorithms.shared.common import PreviousModelClient
    from tests.algorithms.helpers import TinyLinear

    client = PreviousModelClient(TinyLinear(), num_classes=2)
    assert client.num_classes == 2 and client.hp.optimizer == "adam"
    assert all(not p.requires_grad for p in client.previous_model.parameters())
    assert all(p.requires_grad for p in client.model.parameters())
    with torch.no_grad():
        client.model.head.weight.fill_(7.0)
    client.on_train_start()  # previous_round: the start keeps the old teacher
    assert client.previous_model.head.weight.tolist() == [[1.0, 0.0], [0.0, 1.0]]
    client.on_train_end()
    assert client.previous_model.head.weight.eq(7.0).all()

    class AtStart(PreviousModelClient):
        def teacher_choice(self):
            return "post_collaboration"

    early = AtStart(TinyLinear(), num_classes=2, lr=0.5)
    assert early.hp.lr == 0.5
    with torch.no_grad():
        early.model.head.weight.fill_(3.0)
    early.on_train_start()
    assert early.previous_model.head.weight.eq(3.0).all()


def test_a_shared_model_takes_model_arguments():
    """Model arguments (FedMRL's ``feature_dim`` of its small model) reach the model's constructor."""
    from fedhet.algorithms.shared.common import build_shared_model

    assert build_shared_model("cnn_tiny", 3, 1, 0, "small", feature_dim=8).num_features == 8


def test_a_download_replaces_the_state_only_when_it_holds_all_the_client_keeps():
    """FedAvg's whole-model download replaces a FedAvg client's state; a partial one, none, or extra state do not."""
    from fedhet.algorithms.feddyn import FedDynClient
    from tests.algorithms.helpers import TinyLinear

    client = FedAvgClient(TinyLinear(), num_classes=2)
    whole = WeightsPayload(weights={k: v.clone() for k, v in client.model.state_dict().items()})
    assert client.download_replaces_state(whole)
    partial = WeightsPayload(weights={k: v for k, v in whole.weights.items() if not k.startswith("head.")})
    assert not client.download_replaces_state(partial)  # the head stays the client's own (FedPer-like)
    assert not client.download_replaces_state(None)  # nothing received yet (LG-FedAvg's first round)
    assert not client.download_replaces_state(ClassStatsPayload(values=torch.zeros(2, 2), counts=torch.ones(2)))
    keeping = FedDynClient(TinyLinear(), num_classes=2)  # keeps its gradient state beside the model
    assert not keeping.download_replaces_state(whole)
