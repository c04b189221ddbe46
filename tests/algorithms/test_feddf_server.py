"""feddf_server: per-architecture averaging, then server-side ensemble distillation, by hand."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from fedhet.algorithms import FedAvg, FedDFServer, FedProto, FedProx
from fedhet.algorithms.base import ClientUpload, LocalStage, ServerContext
from fedhet.algorithms.fedavg import FedAvgServer
from fedhet.algorithms.feddf_server import EnsembleDistillation
from fedhet.algorithms.shared.common import SubmoduleAveragingServer
from fedhet.core.payloads import WeightsPayload
from fedhet.errors import ConfigError
from tests.algorithms.helpers import TinyLinear, fit

SWAP = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
X = torch.tensor([[1.0, 0.0]])


def _weights(head: torch.Tensor) -> dict[str, torch.Tensor]:
    """A TinyLinear's state dict with identity body and ``head`` (no bias)."""
    return {k: v.clone() for k, v in TinyLinear(head=head).state_dict().items()}


def _context(architectures=("a", "b")) -> ServerContext:
    """Two clients of two architectures, all TinyLinear with identity weights, and a public loader."""
    public = DataLoader(TensorDataset(X.repeat(4, 1)), batch_size=1)
    return ServerContext(
        num_clients=len(architectures),
        num_classes=2,
        architectures=tuple(architectures),
        seed=0,
        initial_client_state=lambda cid: {f"model.{k}": v for k, v in _weights(torch.eye(2)).items()},
        model_factory=lambda architecture, seed: TinyLinear(),
        public_loader=lambda seed: public,
    )


def _refinement(uploads, temperature=1.0, steps=1) -> tuple[FedAvgServer, EnsembleDistillation]:
    """A FedAvg server of two architectures, aggregated, with the distillation stage set up for ``uploads``."""
    base = FedAvgServer()
    context = _context()
    base.setup_server(context)
    refinement = EnsembleDistillation(distill_steps=steps, distill_lr=0.1, temperature=temperature)
    refinement.attach(base, context)
    base.aggregate(0, uploads)
    refinement.begin_round(0, uploads)
    return base, refinement


def test_averages_within_each_architecture_by_hand():
    """Two uploads of architecture a (30 and 10 examples) average to 0.75 h1 + 0.25 h2; b keeps its own."""
    uploads = [
        ClientUpload(0, "a", WeightsPayload(num_examples=30, weights=_weights(torch.eye(2)))),
        ClientUpload(1, "a", WeightsPayload(num_examples=10, weights=_weights(SWAP))),
    ]
    base, _ = _refinement(uploads)
    expected = torch.tensor([[0.75, 0.25], [0.25, 0.75]])
    assert torch.allclose(base.global_by_architecture["a"]["head.weight"], expected)
    assert torch.equal(base.global_by_architecture["b"]["head.weight"], torch.eye(2))  # nobody of b uploaded


def test_distillation_loss_is_the_kl_to_the_teacher_ensemble_by_hand():
    """Loss = sum over students of T^2 KL(softmax(mean teacher logits / T) || softmax(student / T)), at T = 2."""
    uploads = [
        ClientUpload(0, "a", WeightsPayload(num_examples=1, weights=_weights(torch.eye(2)))),
        ClientUpload(1, "b", WeightsPayload(num_examples=1, weights=_weights(SWAP))),
    ]
    _, refinement = _refinement(uploads, temperature=2.0)
    # teachers on x = [1, 0]: logits [1, 0] and [0, 1] -> ensemble [0.5, 0.5] -> target (1/2, 1/2)
    # students: a's average is the identity head (logits [1, 0]), b's the swap (logits [0, 1])
    q = 1 / (1 + math.exp(-0.5))  # softmax([1, 0] / 2)[0]
    kl = 0.5 * math.log(0.5 / q) + 0.5 * math.log(0.5 / (1 - q))
    expected = 2 * (2.0**2 * kl)  # two students, each KL equal by symmetry
    loss = refinement.training_step((X,), 0)
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_distilled_students_become_the_new_global_models():
    """After the refine fit, the base server's global models are the distilled students, moved towards the ensemble."""
    uploads = [
        ClientUpload(0, "a", WeightsPayload(num_examples=1, weights=_weights(torch.eye(2)))),
        ClientUpload(1, "b", WeightsPayload(num_examples=1, weights=_weights(SWAP))),
    ]
    base, refinement = _refinement(uploads, steps=3)
    before = base.global_by_architecture["a"]["head.weight"].clone()
    fit(refinement, refinement.server_dataloader(0), max_epochs=-1, max_steps=refinement.refine_budget().steps)
    after = base.global_by_architecture["a"]["head.weight"]
    assert not torch.equal(before, after)
    logits = after @ X[0]  # identity body
    assert float(logits[0] - logits[1]) < 1.0  # the student's margin shrank towards the ensemble's 0


def test_plugin_on_fedprox_keeps_fedprox_clients():
    """The plugin builds its base's clients (FedProx's proximal objective), optimizer and averaging server."""
    algorithm = FedDFServer(base=FedProx(mu=0.5, lr=0.05), distill_steps=2)
    assert algorithm.name == "FedDFServer(FedProx)" and algorithm.base.hp.lr == 0.05
    assert type(algorithm.build_client(TinyLinear(), 2)).__name__ == "FedProxClient"
    assert isinstance(algorithm.build_server().base, SubmoduleAveragingServer)
    assert algorithm.evaluation == ("clients", "server") and algorithm.capabilities.needs_public_data


def test_plugin_refuses_a_base_that_does_not_average_weights():
    """FedProto's server is not a weight average: refused at start-up in one line."""
    with pytest.raises(ConfigError, match="weight-averaging"):
        FedDFServer(base=FedProto()).build_server().refinement.attach(FedProto().build_server(), _context())


def test_default_base_is_fedavg():
    """Without a base the plugin refines FedAvg."""
    assert isinstance(FedDFServer().base, FedAvg)


def test_the_distillation_reads_the_plugins_hyperparameters():
    """The stage takes the plugin's distill_steps, distill_lr and temperature; a bad value fails in one line."""
    stage = FedDFServer(base=FedProx(), distill_steps=7, distill_lr=0.01, temperature=2.0).build_refinement()
    assert isinstance(stage, EnsembleDistillation)
    assert (stage.hp.distill_steps, stage.hp.distill_lr, stage.hp.temperature) == (7, 0.01, 2.0)
    assert stage.refine_budget().steps == 7
    with pytest.raises(ConfigError, match=r"^FedDFServer: distill_steps=-1 is not an integer >= 0$"):
        FedDFServer(distill_steps=-1)


class BatchNormNet(torch.nn.Module):
    """``Linear(2, 2) -> BatchNorm1d(2) -> ReLU -> Linear(2, 2)``: a student whose BatchNorm the distillation moves."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(2, 2)
        self.bn = torch.nn.BatchNorm1d(2)
        self.head = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.body(x))))


def _bn_distilled(student_bn: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Two clients' BatchNormNets (running mean [1, -1], var [2, 3]) averaged, then 3 distillation steps.

    Returns the base's global state before and after the refine fit. The public batches (mean 5,
    std 3) are far from the clients' statistics, so train-mode steps move the running statistics.
    """
    public = DataLoader(TensorDataset(5.0 + 3.0 * torch.randn(12, 2, generator=torch.Generator().manual_seed(1))),
                        batch_size=4)
    context = ServerContext(
        num_clients=2,
        num_classes=2,
        architectures=("a", "a"),
        seed=0,
        initial_client_state=lambda cid: {f"model.{k}": v for k, v in BatchNormNet().state_dict().items()},
        model_factory=lambda architecture, seed: BatchNormNet(),
        public_loader=lambda seed: public,
    )
    base = FedAvgServer()
    base.setup_server(context)
    refinement = EnsembleDistillation(distill_steps=3, distill_lr=0.1, student_bn=student_bn)
    refinement.attach(base, context)
    uploads = []
    for cid, scale in ((0, 1.0), (1, -0.5)):
        weights = {k: v.clone() for k, v in BatchNormNet().state_dict().items()}
        weights["bn.running_mean"] = torch.tensor([1.0, -1.0])
        weights["bn.running_var"] = torch.tensor([2.0, 3.0])
        weights["bn.num_batches_tracked"] = torch.tensor(7)
        weights["body.weight"] = scale * weights["body.weight"]  # teachers disagree (ReLU): the students move
        uploads.append(ClientUpload(cid, "a", WeightsPayload(num_examples=1, weights=weights)))
    base.aggregate(0, uploads)
    refinement.begin_round(0, uploads)
    before = {k: v.clone() for k, v in base.global_by_architecture["a"].items()}
    fit(refinement, refinement.server_dataloader(0), max_epochs=-1, max_steps=refinement.refine_budget().steps)
    return before, base.global_by_architecture["a"]


@pytest.mark.parametrize("student_bn", ["frozen", "restore"])
def test_keeping_the_clients_batch_norm_statistics_through_the_distillation(student_bn):
    """With the knob on, the averaged clients' running statistics leave the distillation unchanged (bit for bit)."""
    before, after = _bn_distilled(student_bn)
    assert torch.equal(before["bn.running_mean"], torch.tensor([1.0, -1.0]))
    for key in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        assert torch.equal(after[key], before[key]), key
    assert not torch.equal(after["head.weight"], before["head.weight"])  # the distillation did train
    assert not torch.equal(after["body.weight"], before["body.weight"])


def test_paper_default_lets_the_distillation_overwrite_batch_norm_statistics():
    """student_bn="train" (default, the paper's code): the running statistics move towards the public data."""
    assert EnsembleDistillation().hp.student_bn == "train"
    before, after = _bn_distilled("train")
    assert not torch.equal(after["bn.running_mean"], before["bn.running_mean"])
    assert int(after["bn.num_batches_tracked"]) == 7 + 3


def test_student_bn_and_the_distillation_budget_are_in_the_search_space():
    """The tuning stage can trade the budget against the BatchNorm handling (declared defaults inside)."""
    from fedhet.algorithms.feddf_server import FedDFServerHparams
    from fedhet.hparams import sweep_parameters

    space = sweep_parameters(FedDFServerHparams)
    assert space["method.init_args.student_bn"] == {"values": ["train", "frozen", "restore"]}
    assert space["method.init_args.distill_steps"] == {"distribution": "int_uniform", "min": 0, "max": 1000}
    with pytest.raises(ConfigError, match="student_bn"):
        FedDFServer(student_bn="eval")


def test_the_distillation_refuses_what_it_cannot_refine_by_name():
    """A base that does not average weights, no public data or no model factory: one line each."""
    with pytest.raises(ConfigError) as error:
        EnsembleDistillation().attach(FedProto().build_server(), _context())
    assert str(error.value) == (
        "feddf_server refines weight-averaging bases (FedAvg, FedProx, MOON, FedProc, FedRS), not ClassMeanServer; "
        "set method.init_args.base to one of them"
    )
    messages = {
        "public_loader": "feddf_server needs unlabeled public data; set --scenario.public photos",
        "model_factory": "feddf_server needs the server context's model_factory to build its students; "
        "build the ServerContext with model_factory=...",
    }
    for missing, message in messages.items():
        with pytest.raises(ConfigError) as error:
            EnsembleDistillation().attach(FedAvgServer(), dataclasses.replace(_context(), **{missing: None}))
        assert str(error.value) == message, missing


def test_the_distillation_builds_students_and_frozen_templates_per_architecture_from_the_seeded_factory():
    """One student and one frozen teacher template per architecture, built by the factory under the run seed."""
    calls = []

    def factory(architecture, seed):
        calls.append((architecture, seed))
        return TinyLinear()

    context = dataclasses.replace(_context(("a", "b", "a")), model_factory=factory, seed=3)
    base = FedAvgServer()
    base.setup_server(context)
    stage = EnsembleDistillation()
    stage.attach(base, context)
    assert calls == [("a", 3), ("a", 3), ("b", 3), ("b", 3)]
    assert list(stage.students) == ["a", "b"]
    assert all(p.requires_grad for p in stage.students.parameters())
    assert not any(p.requires_grad for p in stage.templates.parameters())


def test_the_distillation_runs_only_with_teachers_and_steps_and_reads_the_public_loader_with_its_seed():
    """No step without this round's teachers or with ``distill_steps = 0``; the public loader gets the stage seed."""
    uploads = [ClientUpload(0, "a", WeightsPayload(weights=_weights(torch.eye(2)), num_examples=1))]
    _, stage = _refinement(uploads, steps=1)
    assert stage.should_refine() and stage.refine_budget() == LocalStage(name="distill", steps=1)
    assert stage.configure_optimizers()["lr_scheduler"]["scheduler"].T_max == 1
    assert stage.metrics() == {}  # nothing distilled yet
    seeds = []
    stage.context = dataclasses.replace(stage.context, public_loader=lambda seed: seeds.append(seed) or [])
    stage.server_dataloader(5)
    assert seeds == [5]
    _, idle = _refinement(uploads, steps=0)
    assert not idle.should_refine()
    _, empty = _refinement([], steps=1)
    assert not empty.should_refine()
    assert EnsembleDistillation().metrics() == {}
