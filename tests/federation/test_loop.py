"""The round loop: resume, state stores, optimizer state, collaborative and trainable server phases."""

from __future__ import annotations

import math
from collections.abc import Sequence

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhet.algorithms.base import Algorithm, ClientModule, ClientUpload, CollaborativePhase, TrainableServerPhase
from fedhet.algorithms.fedavg import FedAvg
from fedhet.algorithms.local import Local
from fedhet.core.payloads import Payload, WeightsPayload
from fedhet.errors import TrainingError
from fedhet.federation import DiskStateStore, FederationLoop
from fedhet.federation.trainer import TrainerTemplate
from tests.conftest import loop_args, tiny_domain_shift, tiny_label_skew


def _loop(algorithm, rounds=4, seed=0, scenario=None, store=None, callbacks=(), architectures=None, **kwargs):
    scenario = scenario or tiny_label_skew()
    scenario.setup()
    architectures = architectures or ["cnn_tiny", "mlp_tiny", "cnn_tiny"][: scenario.num_clients]
    return FederationLoop(
        algorithm,
        scenario,
        architectures,
        TrainerTemplate(max_epochs=1, accelerator="cpu"),
        rounds=rounds,
        seed=seed,
        state_store=store,
        callbacks=callbacks,
        **loop_args(kwargs),
    )


class _StopAfter:
    """Simulates a kill right after round ``n`` was checkpointed."""

    def __init__(self, n, sink):
        self.n, self.sink = n, sink

    def on_round_end(self, loop, record):
        self.sink.append(loop.checkpoint_state())
        if record["round"] + 1 == self.n:
            raise KeyboardInterrupt

    def on_run_end(self, loop, summary):
        pass


@pytest.mark.parametrize("store_kind", ["memory", "disk"])
def test_resume_after_round_two_equals_uninterrupted(store_kind, tmp_path):
    """A run killed after round 2 and resumed from its checkpoint ends with the uninterrupted results."""
    def store(name):
        return DiskStateStore(tmp_path / name) if store_kind == "disk" else None

    full = _loop(Local(lr=0.05, momentum=0.9), store=store("full")).run()
    checkpoints: list = []
    interrupted = _loop(Local(lr=0.05, momentum=0.9), store=store("part"), callbacks=[_StopAfter(2, checkpoints)])
    with pytest.raises(KeyboardInterrupt):
        interrupted.run()
    # round-trip the checkpoint through torch.save / weights_only load, as the run directory does
    path = tmp_path / "ckpt.pt"
    torch.save(checkpoints[-1], path)
    state = torch.load(path, weights_only=True)
    resumed = _loop(Local(lr=0.05, momentum=0.9), store=store("part"))
    resumed.load_checkpoint_state(state)
    assert resumed.next_round == 2
    summary = resumed.run()
    assert summary["final"] == full["final"]
    assert summary["best"] == full["best"]
    assert summary["comm"] == full["comm"]


def test_disk_store_gives_the_same_numbers_as_memory(tmp_path):
    """Keeping client states on disk gives the same final metrics as in memory."""
    memory = _loop(FedAvg(lr=0.05), rounds=2, architectures=["cnn_tiny"] * 3).run()
    disk = _loop(FedAvg(lr=0.05), rounds=2, architectures=["cnn_tiny"] * 3, store=DiskStateStore(tmp_path)).run()
    assert memory["final"] == disk["final"]


def test_optimizer_state_survives_rounds():
    """Momentum buffers are stored with the client and carried to the next round (unless turned off)."""
    loop = _loop(Local(lr=0.05, momentum=0.9), rounds=2)
    loop.run()
    state = loop.store.get(0)["optimizer"]
    assert state is not None and len(state) == 1
    buffers = [v["momentum_buffer"] for v in state["local"][0]["state"].values()]
    assert buffers and all(torch.isfinite(b).all() for b in buffers)
    # turning persistence off restarts the optimizer each round and changes the trajectory
    off = _loop(Local(lr=0.05, momentum=0.9), rounds=2, persist_optimizer_state=False).run()
    on = _loop(Local(lr=0.05, momentum=0.9), rounds=2).run()
    assert off["final"] != on["final"]


def test_partial_participation_trains_only_sampled_clients():
    """With one participant per round only the sampled client gets a stored state."""
    loop = _loop(Local(lr=0.05), rounds=1, participation=1)
    loop.run()
    trained = [cid for cid in range(3) if loop.store.get(cid) is not None]
    assert len(trained) == 1 and loop.history[0]["clients"] == 1


def test_nan_loss_is_a_clear_error():
    """A diverged client (non-finite loss) stops the run with a TrainingError."""
    loop = _loop(Local(lr=1e30), rounds=1)
    with pytest.raises(TrainingError, match="non-finite"):
        loop.run()


# --------------------------------------------------------------- collaborative phase
class _ConsensusPhase(CollaborativePhase):
    """Each client is pulled towards the mean of all clients' current logits (FedMD-style, lock-step)."""

    seen_batches: list = []

    def collaborative_losses(self, x: Tensor) -> list[Tensor]:
        logits = [client(x) for client in self.clients]
        consensus = torch.stack([z.detach() for z in logits]).mean(0)
        type(self).seen_batches.append(x[:1, 0, 0, 0].clone())
        self.exchanged_bytes_up += sum(z.numel() * z.element_size() for z in logits)
        self.exchanged_bytes_down += consensus.numel() * consensus.element_size() * len(logits)
        return [F.l1_loss(z, consensus) for z in logits]


class _Consensus(Algorithm):
    def build_collaborative_phase(self, clients: Sequence[ClientModule]) -> CollaborativePhase:
        return _ConsensusPhase(clients)

    def collaborative_epochs(self) -> int:
        return 1


def test_collaborative_phase_steps_all_clients_on_the_same_batches():
    """The lock-step phase takes one step per public batch for all clients and counts its bytes."""
    scenario = tiny_domain_shift()
    loop = _loop(_Consensus(lr=0.05), rounds=1, scenario=scenario)
    _ConsensusPhase.seen_batches = []
    loop.run()
    batches = -(-scenario.public_size // scenario.public_batch_size)
    assert len(_ConsensusPhase.seen_batches) == batches  # one step per public batch, all clients together
    record = loop.history[0]
    n, c = scenario.public_size, scenario.num_classes
    assert record["comm/bytes_up"] == 3 * n * c * 4
    assert record["comm/bytes_down"] == 3 * n * c * 4


def test_collaborative_losses_do_not_leak_gradients_across_clients():
    """One client's collaborative loss leaves the other clients' gradients empty."""
    scenario = tiny_domain_shift()
    scenario.setup()
    loop = _loop(_Consensus(lr=0.05), rounds=1, scenario=scenario)
    modules = [loop.runtime.module("cnn_tiny", 0), loop.runtime.module("cnn_tiny", 1)]
    phase = _ConsensusPhase(modules)
    x = torch.randn(4, 3, 16, 16)
    losses = phase.collaborative_losses(x)
    losses[0].backward()
    assert all(p.grad is None for p in modules[1].parameters())


# --------------------------------------------------------------- trainable server phase
class _DistillServer(TrainableServerPhase):
    """Averages client heads, then fits a server model on public data (exercises the server Trainer)."""

    def __init__(self):
        super().__init__()
        self.student = nn.Linear(3 * 16 * 16, 3)
        self.steps = 0
        self.received = 0
        self.positions: list[tuple[str, int, int]] = []

    def aggregate(self, round_idx, uploads: Sequence[ClientUpload]) -> None:
        self.received = len(uploads)
        self.positions.append((self.phase, self.round_idx, self.total_rounds))

    def server_dataloader(self, seed):
        return self.context.public_loader(seed)

    def training_step(self, batch, batch_idx):
        self.steps += 1
        x = batch[0].flatten(1)
        return self.student(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def download_for(self, client_id) -> Payload:
        return WeightsPayload(weights={k: v.detach().cpu() for k, v in self.student.state_dict().items()})

    def metrics(self):
        return {"steps": float(self.steps)}


class _Distill(Algorithm):
    def build_server(self):
        return _DistillServer()


def test_trainable_server_phase_is_fitted_each_round():
    """A trainable server phase is fitted on its own data every round, one step per batch."""
    scenario = tiny_domain_shift()
    loop = _loop(_Distill(lr=0.05), rounds=2, scenario=scenario)
    summary = loop.run()
    batches = -(-scenario.public_size // scenario.public_batch_size)
    assert loop.history[0]["server/steps"] == batches
    assert loop.history[1]["server/steps"] == 2 * batches
    assert summary["comm"]["bytes_down"] > 0 and math.isfinite(summary["final"]["acc_intra"])
    # the round position reaches the server as it reaches every client: round 0, then 1, of 2
    assert loop.server.positions == [("federation", 0, 2), ("federation", 1, 2)]


def test_a_trainable_server_keeps_lightnings_hooks_and_its_own_state_names():
    """setup(stage) and state_dict() are Lightning's; server_state() round-trips the module's tensors."""
    assert TrainableServerPhase.setup is pl.LightningModule.setup
    assert TrainableServerPhase.state_dict is nn.Module.state_dict
    server, restored = _DistillServer(), _DistillServer()
    with torch.no_grad():
        server.student.weight.fill_(2.0)
    restored.load_server_state(server.server_state())
    assert torch.equal(restored.student.weight, torch.full((3, 3 * 16 * 16), 2.0))
    assert list(server.server_state()) == ["student.weight", "student.bias"]


def test_eval_after_local_training_adds_the_clients_own_scores_without_changing_the_run():
    """``pre/`` metrics score each client as its local training left it; the usual metrics stay bitwise.

    Local clients receive no download, so both scores are the same model's and must be equal;
    FedAvg's usual score is the global model's, which differs from the clients' own.
    """
    local = _loop(Local(lr=0.05), rounds=2, eval_after_local_training=True)
    record = local.run() and local.history[-1]
    plain = {k: v for k, v in record.items() if k.startswith(("acc_", "val/acc_"))}
    assert plain
    for key, value in plain.items():
        pre_key = f"pre/{key}" if not key.startswith("val/") else f"val/pre/{key[4:]}"
        assert record[pre_key] == value

    homogeneous = ["cnn_tiny"] * 3
    with_pre = _loop(FedAvg(lr=0.05), rounds=2, architectures=homogeneous, eval_after_local_training=True)
    without = _loop(FedAvg(lr=0.05), rounds=2, architectures=homogeneous)
    with_pre.run()
    without.run()
    last, reference = with_pre.history[-1], without.history[-1]
    assert not any(k.startswith(("pre/", "val/pre/")) for k in reference)
    for key, value in reference.items():
        if key.startswith(("acc_", "domain/", "val/")):
            assert last[key] == value, key
    assert any(last[f"pre/{k}"] != reference[k] for k in reference if k.startswith("acc_"))
