"""Contract v2: server stages and plugins, declared state, evaluation targets, phases, executors, uploads."""

from __future__ import annotations

import time

import pytest
import torch

from fedhet.algorithms import FedAvg, FedDFServer, FedGen, FedProx
from fedhet.algorithms.base import RunPhase
from fedhet.algorithms.fedavg import FedAvgClient
from fedhet.core.payloads import WeightsPayload
from fedhet.errors import ConfigError, TrainingError
from fedhet.federation import FederationLoop, ProcessExecutor
from fedhet.federation.trainer import TrainerTemplate
from tests.conftest import loop_args, tiny_label_skew


def _loop(algorithm, rounds=2, architectures=None, trainer=None, scenario=None, **kwargs):
    """A tiny label-skew run of ``algorithm`` (3 clients)."""
    scenario = scenario or tiny_label_skew()
    scenario.setup()
    return FederationLoop(
        algorithm,
        scenario,
        architectures or ["cnn_tiny"] * scenario.num_clients,
        trainer or TrainerTemplate(max_epochs=1, accelerator="cpu"),
        rounds=rounds,
        **loop_args(kwargs),
    )


def _state_hash(state) -> float:
    """A number that changes with any value of a (nested) client state."""
    if isinstance(state, torch.Tensor):
        return float(state.double().sum()) + float(state.double().abs().sum()) * 1e-3
    if isinstance(state, dict):
        return sum(_state_hash(v) for v in state.values())
    if isinstance(state, list):
        return sum(_state_hash(v) for v in state)
    return 0.0


# ------------------------------------------------------------------ server plugins
def test_feddf_server_refines_heterogeneous_per_architecture_averages():
    """feddf_server runs on two architectures, changes each architecture's average, and reports acc_server."""
    public = tiny_label_skew(public="photos", public_size=64, public_batch_size=32)
    architectures = ["cnn_tiny", "mlp_tiny", "cnn_tiny"]
    loop = _loop(FedDFServer(base=FedAvg(lr=0.05), distill_steps=3), architectures=architectures, scenario=public)
    summary = loop.run()
    assert set(loop.server.base.global_by_architecture) == {"cnn_tiny", "mlp_tiny"}
    assert loop.history[-1]["server/distill_loss"] > 0
    assert 0.0 <= summary["final"]["acc_server"] <= 100.0 and "acc_server" in summary["last3"]
    download = loop.server.download_for(1)
    assert (
        isinstance(download, WeightsPayload)
        and download.weights.keys() == loop.runtime.build_network("mlp_tiny", 0).state_dict().keys()
    )


def test_feddf_server_refuses_a_base_without_weight_averaging():
    """A plugin on a base that does not average weights fails at start-up with one line."""
    from fedhet.algorithms import FedProto

    public = tiny_label_skew(public="photos", public_size=64, public_batch_size=32)
    with pytest.raises(ConfigError, match="weight-averaging"):
        _loop(FedDFServer(base=FedProto()), scenario=public, feature_dim=16)


def test_server_stage_budget_ignores_client_trainer_limits():
    """trainer.max_steps and limit_train_batches cut client fits, never the server's generator steps."""
    trainer = TrainerTemplate(max_epochs=1, max_steps=2, limit_train_batches=1, accelerator="cpu")
    loop = _loop(
        FedGen(generator_steps=7),
        rounds=1,
        architectures=["cnn_tiny", "mlp_tiny", "cnn_tiny"],
        trainer=trainer,
        feature_dim=16,
    )
    loop.run()
    assert loop.server.steps_done == 7


# ------------------------------------------------------------------ declared state
def test_received_modules_are_neither_kept_nor_overwritten():
    """FedGen's generator is received, not kept: it is not in the stored state and survives a state load."""
    loop = _loop(
        FedGen(generator_steps=2), rounds=1, architectures=["cnn_tiny", "mlp_tiny", "cnn_tiny"], feature_dim=16
    )
    loop.run()
    state = loop.store.get(0)["module"]
    assert state and not any(k.startswith("generator.") for k in state)
    module = loop.runtime.module("cnn_tiny")
    marker = {k: torch.full_like(v, 3.0) for k, v in module.generator.state_dict().items() if v.is_floating_point()}
    module.generator.load_state_dict(marker, strict=False)
    module.load_client_state(state)
    assert all(torch.equal(module.generator.state_dict()[k], v) for k, v in marker.items())


# ------------------------------------------------------------------ evaluation targets
class _BeforeAndAfter(FedAvg):
    """FedAvg that also evaluates each client's model before the download (FedMD-CG's L.acc)."""

    evaluation = ("clients", "clients_before_download", "server")


def test_evaluation_targets_before_after_and_server():
    """Before-download metrics differ from after-download ones; the server's model is scored once as acc_server."""
    loop = _loop(_BeforeAndAfter(lr=0.05))
    summary = loop.run()
    record = loop.history[-1]
    assert "pre/acc_local" in record and "val/pre/acc_local" in record
    assert record["pre/acc_global"] != record["acc_global"]
    # with FedAvg every client holds the global model after the download: its global accuracy is the server's
    assert record["acc_global"] == pytest.approx(record["acc_server"])
    assert {"acc_server", "acc_server_round", "val/acc_server"} <= set(summary["best"])


def test_eval_clients_participants_and_sampled():
    """eval_clients evaluates the round's participants, or a seeded sample, and says how many."""
    scenario = tiny_label_skew(num_clients=6)
    loop = _loop(FedAvg(lr=0.05), rounds=1, scenario=scenario, participation=2, eval_clients="participants")
    loop.run()
    record = loop.history[-1]
    assert record["eval/clients"] == 2 and len(loop.last_matrix["rows"]) == 2
    assert sum(key.endswith("/acc_local") and key.startswith("client/") for key in record) == 2
    sampled = _loop(FedAvg(lr=0.05), rounds=1, scenario=tiny_label_skew(num_clients=6), eval_clients=4)
    assert sampled.clients_to_evaluate(0) == sampled.clients_to_evaluate(0) and len(sampled.clients_to_evaluate(0)) == 4


# ------------------------------------------------------------------ run phases
class _FinetuneAfter(FedAvg):
    """FedAvg with two purely local fine-tuning steps after the rounds."""

    def phases(self):
        """Two local steps after the federation."""
        return (RunPhase("finetune", "after", rounds=2, exchange=False),)


def test_run_phase_resumed_in_the_middle_equals_uninterrupted():
    """A run stopped inside its post-federation phase and resumed ends with the same states and numbers."""
    whole = _loop(_FinetuneAfter(lr=0.05), rounds=2)
    summary = whole.run()
    assert [r.get("phase") for r in whole.history] == [None, None, "finetune", "finetune"]
    assert summary["phases"] == ["finetune"] and summary["comm"]["bytes_up"] == whole.history[1]["comm/bytes_up_total"]

    first = _loop(_FinetuneAfter(lr=0.05), rounds=2)
    for step in range(3):  # both rounds and the first fine-tuning step
        first.history.append(first.run_round(step))
        first.next_round = step + 1
        first.store.prune()
    checkpoint = first.checkpoint_state()
    resumed = _loop(_FinetuneAfter(lr=0.05), rounds=2)
    resumed.load_checkpoint_state(checkpoint)
    assert resumed.run()["final"] == summary["final"]
    for cid in range(3):
        assert _state_hash(resumed.store.get(cid)) == _state_hash(whole.store.get(cid))


def test_extra_rounds_run_with_full_participation():
    """federation.extra_rounds adds full-participation steps after the rounds."""
    loop = _loop(FedAvg(lr=0.05), rounds=1, participation=1, extra_rounds=2)
    loop.run()
    assert [r["clients"] for r in loop.history] == [1, 3, 3]
    assert [r.get("phase") for r in loop.history] == [None, "extra", "extra"]


# ------------------------------------------------------------------ executors
@pytest.mark.parametrize("memory_format", ["contiguous", "channels_last"])
def test_process_executor_rebuilt_from_recipe_gives_sequential_numbers(memory_format):
    """Client steps in spawned workers (runtime rebuilt from the recipe) equal the in-process run exactly.

    Also with channels-last modules: workers rebuild them in the template's layout, so the same
    kernels run wherever a client lands.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    trainer = TrainerTemplate(max_epochs=1, accelerator="cpu", memory_format=memory_format)
    try:
        sequential = _loop(FedProx(mu=0.01, lr=0.05), rounds=2, trainer=trainer)
        expected = sequential.run()
        parallel = _loop(FedProx(mu=0.01, lr=0.05), rounds=2, trainer=trainer,
                         executor=ProcessExecutor(workers=2, threads_per_worker=1))
        got = parallel.run()
    finally:
        torch.set_num_threads(threads)
    assert got["final"] == expected["final"] and got["comm"] == expected["comm"]
    for cid in range(3):
        assert _state_hash(parallel.store.get(cid)) == _state_hash(sequential.store.get(cid))
    assert parallel.executor._pool is None  # shut down by the loop


# ------------------------------------------------------------------ uploads that do not fit
class _PoisonClient(FedAvgClient):
    """Client 1 of the run sends a finite but huge update (1e30 in one tensor)."""

    def make_upload(self, train_batches):
        """The honest upload, or a poisoned one for the client holding 1 000 000 in a marker."""
        upload = super().make_upload(train_batches)
        if getattr(self, "poisoned", False):
            key = next(iter(upload.weights))
            upload.weights[key] = torch.full_like(upload.weights[key], 1e30)
        return upload


class _Poisoned(FedAvg):
    """FedAvg whose clients poison their upload when their id is 1."""

    client_type = _PoisonClient


def _poisoned_loop(**kwargs):
    """A run in which client 1 poisons every upload."""
    loop = _loop(_Poisoned(lr=0.05), rounds=1, **kwargs)
    original = loop.runtime._load

    def load(module, task, apply_download=True):
        module.poisoned = task.client_id == 1
        return original(module, task, apply_download)

    loop.runtime._load = load
    return loop


def test_norm_bound_names_the_poisoned_client_where_it_enters():
    """With a norm bound, the huge upload is refused in the round it is sent, naming its sender."""
    with pytest.raises(TrainingError, match=r"round 0: client 1 sent a value of magnitude 1e\+30"):
        _poisoned_loop(upload_norm_bound=10.0).run()


def test_drop_policy_continues_without_the_bad_upload():
    """on_invalid_upload=drop aggregates the honest uploads only and counts the dropped one."""
    loop = _poisoned_loop(upload_norm_bound=10.0, on_invalid_upload="drop")
    loop.run()
    assert loop.history[-1]["comm/dropped_uploads"] == 1
    assert all(
        torch.isfinite(t).all() and t.abs().max() < 1e6
        for t in loop.server.global_weights.values()
        if t.is_floating_point()
    )


def test_an_architecture_whose_fingerprint_costs_more_than_its_shared_scores_is_scored_without_the_cache(
    monkeypatch,
):
    """Hashing ResNet-152 cost more than scoring HtFLlib's 20 global images: the cache must be dropped, not the numbers.

    A fingerprint made slower than any evaluation here is computed for the first client of each
    architecture only; the run's numbers are those of the run that caches.
    """
    from fedhet.federation import runtime

    def scores(loop):
        """Every number of the run's history but its timings."""
        return [{k: v for k, v in record.items() if not k.startswith("time/")} for record in loop.history]

    calls = []
    original = runtime.model_fingerprint

    def slow_fingerprint(module, download=None):
        """The real fingerprint, after half a second of CPU work (longer than scoring the tiny shared sets)."""
        calls.append(1)
        until = time.thread_time() + 0.5
        while time.thread_time() < until:
            pass
        return original(module, download)

    reference = _loop(FedAvg(lr=0.05), rounds=2)
    reference.run()
    assert reference.runtime._fingerprint_pays == {"cnn_tiny": True}
    monkeypatch.setattr(runtime, "model_fingerprint", slow_fingerprint)
    uncached = _loop(FedAvg(lr=0.05), rounds=2)
    uncached.run()
    assert len(calls) == 1  # at the architecture's first client; every later client is scored directly
    assert uncached.runtime._fingerprint_pays == {"cnn_tiny": False}
    assert scores(uncached) == scores(reference)


def test_integer_typed_weights_are_refused():
    """Weights sent as integers where the global model holds floats are refused naming the sender."""
    reference = {"w": torch.zeros(2)}
    with pytest.raises(TrainingError, match="client 4 sent 'weights.w' as torch.int64"):
        WeightsPayload(weights={"w": torch.zeros(2, dtype=torch.long)}).validate_against(reference, "client 4")


def test_shared_sets_are_scored_once_per_distinct_model():
    """Clients holding one model after the download (FedAvg; FedDyn despite its training-only state) share scores.

    The global test and validation sets are evaluated once per step, each client's own splits once each.
    """
    from fedhet.algorithms import FedDyn

    for algorithm in (FedAvg(lr=0.05), FedDyn(lr=0.05)):
        loop = _loop(algorithm, rounds=1)
        evaluated = []
        original = loop.runtime.evaluate_model

        def counting(model, sets, original=original, evaluated=evaluated):
            """Record the evaluation sets each call scores."""
            evaluated.extend(id(data) for data in sets)
            return original(model, sets)

        loop.runtime.evaluate_model = counting
        loop.run()
        shared = loop.runtime._shared_eval_sets()
        client_sets = evaluated[:-2]  # then the server's model on the global test and validation sets
        assert len(shared) == 2 and sorted(evaluated[-2:]) == sorted(shared), type(algorithm).__name__
        assert sorted(client_sets.count(i) for i in shared) == [1, 1], type(algorithm).__name__
        own = [i for i in client_sets if i not in shared]  # each client's test and validation split, once each
        assert len(own) == len(set(own)) == 6, type(algorithm).__name__
