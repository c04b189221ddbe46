"""FedFTG: the generator, the server fine-tuning's invariants, the plugin on every base, rounds to target."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

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


# ------------------------------------------------------------------ what mutmut's first pass found untested
def test_generator_is_the_codes_cgeneratora_and_its_samples_are_independent():
    """The code's CGeneratorA: width 64 by default, LeakyReLU(0.2), an affine-free output BN.

    In eval mode a sample's image depends on its own noise and label only (the noise and label features are joined
    per sample, along the feature axis).
    """
    generator = ConditionalImageGenerator(noise_dim=8, num_classes=10, image_size=32, channels=3)
    assert generator.width == 64 and generator.noise_dim == 8
    assert generator.noise_layer.out_features == generator.label_layer.out_features == 64 * 8 * 8
    slopes = [m.negative_slope for m in generator.body if isinstance(m, torch.nn.LeakyReLU)]
    assert slopes == [0.2, 0.2]
    assert generator.body[-1].weight is None and generator.body[-1].bias is None  # affine=False
    small = ConditionalImageGenerator(noise_dim=4, num_classes=10, image_size=8, channels=3, width=4).eval()
    noise, labels = torch.randn(3, 4), torch.tensor([1, 2, 3])
    out = small(noise, labels)
    noise[1], labels[1] = torch.randn(4), 7
    changed = small(noise, labels)
    torch.testing.assert_close(changed[0], out[0])
    torch.testing.assert_close(changed[2], out[2])
    assert not torch.allclose(changed[1], out[1])


def test_fine_tuning_contract_values_and_round_boundaries():
    """One manual epoch named ftg; a round refines with one active teacher and one iteration, not with none."""
    from fedhet.algorithms.base import LocalStage

    _, stage, uploads = _stage(iterations=1)
    assert stage.refine_budget() == LocalStage(name="ftg", epochs=1, manual=True)
    stage.begin_round(1, uploads[:1])
    assert stage.active_teachers == 1 and stage.should_refine()
    assert all(not p.requires_grad for teacher in stage.teachers for p in teacher.parameters())
    stage.active_teachers = 0
    assert not stage.should_refine()
    assert FedFTG(batch_size=2).hp.batch_size == 2  # the smallest batch that has a diversity term


def test_round_metrics_are_means_of_the_logged_terms():
    """metrics() is each term's mean over the round's iterations; the generator's diversity is one of them."""
    _, stage, _ = _stage()
    stage._add("x", torch.tensor(2.0))
    stage._add("x", torch.tensor(4.0))
    stage._add("y", torch.tensor(1.0))
    assert stage.metrics() == {"ftg_x": 3.0, "ftg_y": 1.0}
    _, stage, _ = _stage()
    fit(stage, stage.server_dataloader(seed=0))
    metrics = stage.metrics()
    assert "ftg_generator_diversity" in metrics and stage.counts["teacher_accuracy"] == 2  # once per iteration


def test_teacher_accuracy_is_the_share_of_samples_whose_weighted_ensemble_predicts_their_label():
    """``ftg_teacher_accuracy``: per sample, the weighted ensemble's most probable class against y, averaged.

    The teachers' logits are set per batch: samples 0, 1, 3 and 4 of six get their label's class, samples 2 and 5
    the next class, so each batch's share is 4/6 and the round's mean is 2/3.
    """
    _, stage, _ = _stage()
    batch_labels: list[Tensor] = []
    training_step = stage.training_step

    def step(batch, batch_idx):
        batch_labels.append(batch[1])
        return training_step(batch, batch_idx)

    def set_logits(x, teachers):
        labels = batch_labels[-1]
        target = torch.where(torch.arange(len(labels)) % 3 == 2, (labels + 1) % 4, labels)
        logits = 10.0 * torch.nn.functional.one_hot(target, 4).float()
        return logits.expand(len(teachers), *logits.shape) + 0.0 * x.sum()  # images still reach the generator

    stage.training_step, stage.teacher_logits = step, set_logits
    fit(stage, stage.server_dataloader(seed=0))
    assert len(batch_labels) == 2 and all(len(labels) == 6 for labels in batch_labels)
    assert stage.metrics()["ftg_teacher_accuracy"] == pytest.approx(2 / 3)


def test_the_rounds_batches_are_a_function_of_its_seed_alone():
    """Same seed, same (Z, Y) whatever the global random state; another seed, others."""
    _, stage, _ = _stage()
    torch.manual_seed(1)
    first = [torch.cat([z.flatten(), y.float()]) for z, y in stage.server_dataloader(seed=4)]
    torch.manual_seed(2)
    again = [torch.cat([z.flatten(), y.float()]) for z, y in stage.server_dataloader(seed=4)]
    other = [torch.cat([z.flatten(), y.float()]) for z, y in stage.server_dataloader(seed=5)]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


def test_the_global_model_takes_no_gradient_while_the_generator_moves():
    """Hard-sample mining computes no gradient for the global model (it is frozen, not merely not stepped)."""
    _, stage, _ = _stage()
    frozen = []
    generator_loss = stage.generator_loss

    def checked(*args, **kwargs):
        frozen.append(not any(p.requires_grad for p in stage.student.parameters()) and not stage.student.training)
        return generator_loss(*args, **kwargs)

    stage.generator_loss = checked  # type: ignore[method-assign]
    fit(stage, stage.server_dataloader(seed=0))
    assert frozen and all(frozen)


def test_attach_names_what_is_missing_and_the_generator_follows_the_run_seed():
    """Attach fails in one line naming what is missing; the generator's initial weights follow the run seed.

    Without a model factory, data format or label counts the line names all three; the initial weights differ
    between run seeds and repeat at one.
    """
    import dataclasses

    purposes = {"model_factory": "to build the teachers and the fine-tuned model",
                "data_format": "to shape the generator's images",
                "label_counts": "to sample labels and weight the teachers by class"}
    for missing, purpose in purposes.items():
        context = dataclasses.replace(_context(), **{missing: None})
        with pytest.raises(ConfigError) as error:
            DataFreeFineTuning().attach(FedAvgServer(), context)
        assert str(error.value) == (f"FedFTG needs the server context's {missing} {purpose}; "
                                    f"build the ServerContext with {missing}=...")
    with pytest.raises(ConfigError, match="architectures; use a homogeneous family, e.g. --models cpu_homo$"):
        DataFreeFineTuning().attach(FedAvgServer(), _context(("cnn_tiny", "mlp_tiny", "cnn_tiny")))
    prototype_server = FedProto().build_server()
    with pytest.raises(ConfigError, match=f"not {type(prototype_server).__name__}; set method.init_args.base to one "
                                          "of them$"):  # fmt: skip
        DataFreeFineTuning().attach(prototype_server, _context())

    def generator_at(seed):
        stage = DataFreeFineTuning(noise_dim=5, generator_width=4)
        stage.attach(FedAvgServer(), dataclasses.replace(_context(), seed=seed))
        return state_digests(stage.generator.state_dict())

    assert generator_at(0) == generator_at(0) != generator_at(1)


def test_no_plain_average_before_the_first_round():
    """Before any round there is no plain average to score: no reference model, not an error."""
    base, stage, context = FedAvgServer(), DataFreeFineTuning(noise_dim=5, generator_width=4), _context()
    base.setup_server(context)
    stage.attach(base, context)
    assert stage.plain_average_model() is None
    base.refinement = stage  # type: ignore[attr-defined]
    assert FedFTG().reference_models(base) == {}
    assert FedFTG().reference_models(FedAvgServer()) == {}  # a server without a refinement
