"""FedFTG: the generator, the server fine-tuning's invariants, the plugin on every base, rounds to target."""

from __future__ import annotations

import pytest
import torch

from fedhet.algorithms import SCAFFOLD, FedAvg, FedFTG, FedProto
from fedhet.algorithms.base import ClientUpload, DataFormat, ServerContext
from fedhet.algorithms.fedavg import FedAvgServer
from fedhet.algorithms.fedftg import ConditionalImageGenerator, DataFreeFineTuning
from fedhet.algorithms.scaffold import ScaffoldPayload
from fedhet.core.payloads import WeightsPayload
from fedhet.errors import ConfigError
from fedhet.models import create_model
from tests.algorithms.helpers import fit, label_skew_run, state_digests

COUNTS = torch.tensor([[6, 0, 0, 2], [0, 4, 0, 2], [1, 1, 1, 1]])


def _network(architecture: str = "cnn_tiny", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return create_model(architecture, num_classes=4)


def _context(architectures=("cnn_tiny",) * 3) -> ServerContext:
    return ServerContext(
        num_clients=len(architectures),
        num_classes=4,
        architectures=tuple(architectures),
        seed=0,
        initial_client_state=lambda cid: {f"model.{k}": v for k, v in _network().state_dict().items()},
        data_format=DataFormat(image_size=8, channels=3, mean=(0.0,) * 3, std=(1.0,) * 3, num_classes=4),
        label_counts=COUNTS[: len(architectures)],
        model_factory=lambda architecture, seed: _network(architecture, seed),
    )


def _stage(**overrides) -> tuple[FedAvgServer, DataFreeFineTuning, list[ClientUpload]]:
    """A FedAvg server with FedFTG attached and a round of two uploads (clients 0 and 1) begun."""
    settings = dict(iterations=2, batch_size=6, noise_dim=5, generator_width=4)
    settings.update(overrides)
    base, stage, context = FedAvgServer(), DataFreeFineTuning(**settings), _context()
    base.setup_server(context)
    stage.attach(base, context)
    uploads = [
        ClientUpload(cid, "cnn_tiny", WeightsPayload(num_examples=8, weights=_network(seed=cid + 1).state_dict()))
        for cid in (0, 1)
    ]
    base.aggregate(0, uploads)
    stage.begin_round(0, uploads)
    return base, stage, uploads


def test_generator_shapes_and_a_clear_error_for_other_sizes():
    """28x28 starts at 7x7, 32x32 at 8x8 (the paper's); outputs are standardised by the final affine-free BN."""
    for size in (28, 32):
        generator = ConditionalImageGenerator(noise_dim=8, num_classes=10, image_size=size, channels=3, width=4)
        out = generator(torch.randn(16, 8), torch.arange(16) % 10)
        assert out.shape == (16, 3, size, size)
        assert out.mean().abs().item() < 1e-4 and abs(out.std().item() - 1.0) < 0.05
    with pytest.raises(ConfigError, match="divisible by 4"):
        ConditionalImageGenerator(noise_dim=8, num_classes=10, image_size=30, channels=3)


def test_round_statistics_come_from_the_active_clients_only():
    """Clients 0 and 1 are active: p_t = (6, 4, 0, 4) / 14 and alpha of class 3 is (1/2, 1/2)."""
    _, stage, _ = _stage()
    assert stage.label_probs.tolist() == pytest.approx([6 / 14, 4 / 14, 0.0, 4 / 14])
    assert stage.alpha[:, 0].tolist() == pytest.approx([1.0, 0.0], abs=1e-6)
    assert stage.alpha[:, 3].tolist() == pytest.approx([0.5, 0.5], abs=1e-6)
    noise, labels = next(iter(stage.server_dataloader(seed=3)))
    assert noise.shape == (6, 5) and not (labels == 2).any()  # no active client holds class 2: never sampled


def test_generator_step_leaves_global_model_and_teachers_unchanged():
    """A hard-sample-mining step moves theta only; the global model and every teacher stay bit-identical."""
    _, stage, _ = _stage()
    student = state_digests(stage.student.state_dict())
    teachers = [state_digests(t.state_dict()) for t in stage.teachers]
    generator = state_digests(stage.generator.state_dict())
    optimizer = torch.optim.Adam(stage.generator.parameters(), lr=0.01)
    noise, labels = next(iter(stage.server_dataloader(seed=0)))
    weights = stage.alpha[:, labels].t()
    stage.student.eval().requires_grad_(False)
    stage.generator_loss(noise, labels, stage.teachers[:2], weights).backward()
    optimizer.step()
    assert state_digests(stage.student.state_dict()) == student
    assert [state_digests(t.state_dict()) for t in stage.teachers] == teachers
    assert state_digests(stage.generator.state_dict()) != generator


def test_server_round_fine_tunes_the_average_and_keeps_teachers_bn_statistics():
    """After the fit the base holds the fine-tuned model; teachers (BN running stats included) are untouched."""
    base, stage, uploads = _stage()
    average = {k: v.clone() for k, v in base.global_by_architecture["cnn_tiny"].items()}
    teachers = [state_digests(t.state_dict()) for t in stage.teachers]
    fit(stage, stage.server_dataloader(seed=0))
    tuned = base.global_by_architecture["cnn_tiny"]
    assert any(not torch.equal(tuned[k], average[k]) for k in average)
    assert [state_digests(t.state_dict()) for t in stage.teachers] == teachers
    assert all(not t.training for t in stage.teachers)
    metrics = stage.metrics()
    expected = {"ftg_student_loss", "ftg_generator_fidelity", "ftg_generator_discrepancy", "ftg_teacher_accuracy"}
    assert expected <= set(metrics)


def test_student_steps_leave_the_generator_unchanged():
    """With every generator term off its weights can only move if the global-model phase leaks gradients into it."""
    _, stage, _ = _stage(hard_sample_mining=False, lambda_cls=0.0, lambda_dis=0.0)
    before = {k: v.clone() for k, v in stage.generator.named_parameters()}
    fit(stage, stage.server_dataloader(seed=0))
    assert all(torch.equal(before[k], v) for k, v in stage.generator.named_parameters())


def test_ablation_switches_change_the_round_statistics():
    """-cls samples labels uniformly (class 2 appears); -abe weights every teacher 1/|S_t|."""
    _, stage, _ = _stage(label_sampling=False, class_ensemble=False)
    assert stage.label_probs.tolist() == [0.25] * 4
    assert stage.alpha.tolist() == [[0.5] * 4, [0.5] * 4]


def test_refuses_bases_without_weight_averaging_and_several_architectures():
    """FedProto has no averaged model; two architectures have no single model to fine-tune."""
    with pytest.raises(ConfigError, match="weight average"):
        DataFreeFineTuning().attach(FedProto().build_server(), _context())
    with pytest.raises(ConfigError, match="architectures"):
        DataFreeFineTuning().attach(FedAvgServer(), _context(("cnn_tiny", "mlp_tiny", "cnn_tiny")))
    with pytest.raises(ConfigError, match=r"^FedFTG: batch_size=1 must be >= 2$"):
        FedFTG(batch_size=1)


def test_the_fine_tuning_reads_the_plugins_hyperparameters():
    """FedFTG's stage takes the plugin's values (no relay); ranges fail in one line naming the knob."""
    method = FedFTG(base=SCAFFOLD(), iterations=3, lambda_dis=0.5, server_bn_mode="frozen")
    stage = method.build_refinement()
    assert isinstance(stage, DataFreeFineTuning) and stage.hp == method.hp
    hp = stage.hp
    assert (hp.iterations, hp.lambda_dis, hp.server_bn_mode, hp.batch_size) == (3, 0.5, "frozen", 50)
    assert not method.capabilities.heterogeneous_models
    with pytest.raises(ConfigError, match=r"^FedFTG: iterations=-1 is not an integer >= 0$"):
        FedFTG(iterations=-1)
    with pytest.raises(ConfigError, match=r"^FedFTG: student_loss='kl' is not one of 'soft_ce', 'kl_global_first'$"):
        FedFTG(student_loss="kl")


TINY = dict(iterations=2, batch_size=8, noise_dim=8, generator_width=4)


def test_fedftg_on_scaffold_downloads_the_tuned_model_with_control_variates():
    """The base's extras travel with the fine-tuned model: SCAFFOLD's payload carries x (tuned) and c."""
    method = FedFTG(base=SCAFFOLD(optimizer="sgd", lr=0.05, momentum=0.0), **TINY)
    loop, summary = label_skew_run(method, rounds=2)
    download = loop.server.download_for(0)
    assert isinstance(download, ScaffoldPayload) and download.control
    tuned = loop.server.base.global_by_architecture["cnn_tiny"]
    assert all(torch.equal(download.weights[k], tuned[k]) for k in tuned)
    assert "acc_server" in summary["final"]
    assert "generator" in loop.server.server_state()["refinement"]


def test_label_counts_are_every_clients_setup_upload_of_int64_rows():
    """The refined server's setup uploads are the context's count rows as int64: 3 clients x 4 classes x 8 B = 96."""
    server = FedFTG(base=FedAvg(), **TINY).build_server()
    server.setup_server(_context())
    uploads = server.setup_uploads()
    assert [u.counts.tolist() for u in uploads] == COUNTS.tolist()
    assert all(u.counts.dtype == torch.int64 for u in uploads)
    assert sum(u.nbytes() for u in uploads) == 96
    assert FedAvg().build_server().setup_uploads() == ()  # a plain server sends nothing before round 0


def test_label_counts_are_charged_once_and_rounds_to_target_reported():
    """FedFTG's label counts count as round-0 upload; rounds_to_target: 1 for a trivial target, None if never."""
    plain, _ = label_skew_run(FedAvg(), rounds=2)
    tuned, summary = label_skew_run(
        FedFTG(base=FedAvg(), **TINY), rounds=2, target_accuracy={"acc_server": [1e-6, 100.0], "acc_global": 100.0}
    )
    counts = 3 * 10 * 8  # three clients, ten int64 counts each
    assert tuned.ledger.total_up == plain.ledger.total_up + counts
    assert summary["rounds_to_target"] == {"acc_server>=1e-06": 1, "acc_server>=100": None, "acc_global>=100": None}
    with pytest.raises(ConfigError, match="percentages"):
        label_skew_run(FedAvg(), rounds=1, target_accuracy={"acc_server": 150.0})


def test_the_plain_average_is_scored_next_to_the_fine_tuned_model_every_round():
    """acc_server_plain_average: the aggregate before fine-tuning, on the same sets, outside acc_server."""
    method = FedFTG(base=FedAvg(), **TINY)
    loop, summary = label_skew_run(method, rounds=2)
    assert all("acc_server_plain_average" in r and "val/acc_server_plain_average" in r for r in loop.history)
    stage = loop.server.refinement
    tuned = loop.server.base.global_by_architecture["cnn_tiny"]
    assert any(not torch.equal(stage.plain_average[k], tuned[k]) for k in tuned)  # fine-tuning moved it
    scored = loop._evaluate_server({"plain": stage.plain_average_model()})
    assert loop.history[-1]["acc_server_plain_average"] == scored["acc_server"]
    assert loop.history[-1]["acc_server"] == loop._evaluate_server(loop.server.server_models())["acc_server"]
    assert "acc_server_plain_average" in summary["final"]
    assert all(m is not stage.plain_average_network[0] for m in stage.modules())  # not a submodule
    # without fine-tuning the broadcast model is the plain average: the two numbers agree exactly
    untuned, _ = label_skew_run(FedFTG(base=FedAvg(), **{**TINY, "iterations": 0}), rounds=1)
    assert untuned.history[-1]["acc_server_plain_average"] == untuned.history[-1]["acc_server"]
    plain, _ = label_skew_run(FedAvg(), rounds=1)
    assert not any(key.startswith("acc_server_") for key in plain.history[-1])  # other methods log nothing new


def test_the_run_position_set_on_a_refined_server_reaches_its_base():
    """The loop sets phase, round and rounds on the wrapper; the base server (FedAvg's) reads the same values."""
    from fedhet.algorithms import FedFTG

    server = FedFTG().build_server()
    server.phase, server.round_idx, server.total_rounds = "finetune", 3, 7
    assert (server.base.phase, server.base.round_idx, server.base.total_rounds) == ("finetune", 3, 7)
    assert (server.phase, server.round_idx, server.total_rounds) == ("finetune", 3, 7)
