"""Every invalid upload is refused where it enters, naming its sender, and droppable (issue 34, items 2-3).

Each malformed upload is sent once, in round 1, by client 0 and by client 1 of a tiny 3-client
run: with ``on_invalid_upload: fail`` the run stops in that round with one line naming that
client; with ``drop`` it completes, the drop is counted, and the global state is never poisoned
(finite, float32, of honest magnitude). Checks are against the server's own model or declared
spec, so the first client's fault is never blamed on the second.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from fedhet.algorithms import SCAFFOLD, FedAvg, FedProto
from fedhet.core.payloads import ClassStatsPayload, WeightsPayload
from fedhet.errors import ConfigError, TrainingError
from fedhet.federation import FederationLoop
from fedhet.federation.aggregation import Aggregator
from fedhet.federation.attacks import UploadAttack
from fedhet.federation.loop import relative_update
from fedhet.federation.trainer import TrainerTemplate
from tests.conftest import loop_args, tiny_label_skew


def _loop(algorithm, rounds=2, **kwargs):
    """A tiny label-skew run (3 clients, two SGD steps per client and round)."""
    scenario = tiny_label_skew()
    scenario.setup()
    return FederationLoop(
        algorithm,
        scenario,
        ["cnn_tiny"] * scenario.num_clients,
        TrainerTemplate(max_epochs=1, max_steps=2, accelerator="cpu"),
        rounds=rounds,
        **loop_args(kwargs),
    )


def _first_key(weights):
    return next(k for k, v in weights.items() if v.is_floating_point() and v.dim() > 1)


def _weights(fn):
    """A malformation of a weights upload: ``fn(weights dict) -> weights dict``."""

    def apply(payload):
        weights = dict(payload.weights)
        return dataclasses.replace(payload, weights=fn(weights))

    return apply


def _set(key_fn):
    def fn(weights):
        key = _first_key(weights)
        weights[key] = key_fn(weights[key])
        return weights

    return fn


def _drop_key(weights):
    del weights[_first_key(weights)]
    return weights


WEIGHT_MALFORMATIONS = {
    "nan": (_weights(_set(lambda t: t.clone().fill_(float("nan")))), "non-finite"),
    "inf": (_weights(_set(lambda t: t.clone().fill_(float("inf")))), "non-finite"),
    "shape": (_weights(_set(lambda t: torch.zeros(t.shape[0] + 1, *t.shape[1:]))), "of shape"),
    "missing_key": (_weights(_drop_key), "keys differ"),
    "int64": (_weights(_set(lambda t: t.round().long())), "as torch.int64"),
    "float16": (_weights(lambda w: {k: v.half() if v.is_floating_point() else v for k, v in w.items()}), "float16"),
    "1e30": (_weights(lambda w: {k: torch.full_like(v, 1e30) if v.is_floating_point() else v for k, v in w.items()}),
             "magnitude 1e\\+30"),
    "x50": (_weights(lambda w: {k: v * 50 if v.is_floating_point() else v for k, v in w.items()}),
            "norm away from it"),
    "negative_examples": (lambda p: dataclasses.replace(p, num_examples=-5), "negative example count"),
}

PROTOTYPE_MALFORMATIONS = {
    "negative_counts": (lambda p: dataclasses.replace(p, counts=p.counts - p.counts.max() - 1), "invalid class counts"),
    "inconsistent_counts": (lambda p: dataclasses.replace(p, counts=p.counts + 10_000), "inconsistent with its data"),
    "prototype_shape": (lambda p: dataclasses.replace(p, values=torch.zeros(p.values.shape[0], p.values.shape[1] + 3)),
                        "of shape"),
    "prototypes_x1e30": (lambda p: dataclasses.replace(p, values=p.values * 1e30 + 1e30), "magnitude"),
    "prototype_float16": (lambda p: dataclasses.replace(p, values=p.values.half()), "float16"),
}


def _inject(loop, client, malform, at_round=1):
    """Client ``client`` sends ``malform(honest upload)`` in round ``at_round`` only."""
    original = loop._screen_uploads

    def screen(step_idx, uploads):
        changed = [
            dataclasses.replace(u, payload=malform(u.payload)) if step_idx == at_round and u.client_id == client else u
            for u in uploads
        ]
        return original(step_idx, changed)

    loop._screen_uploads = screen
    return loop


def _cases():
    for name, (malform, message) in WEIGHT_MALFORMATIONS.items():
        yield pytest.param(FedAvg, malform, message, id=f"fedavg-{name}")
    for name, (malform, message) in PROTOTYPE_MALFORMATIONS.items():
        yield pytest.param(FedProto, malform, message, id=f"fedproto-{name}")


@pytest.mark.parametrize("client", [0, 1])
@pytest.mark.parametrize(("method", "malform", "message"), list(_cases()))
def test_fail_names_the_sender_in_the_round_it_arrives(method, malform, message, client):
    """fail: one line, 'round 1: client <sender> ...' with the problem; round 0 completed, round 1 not."""
    loop = _inject(_loop(method(lr=0.05)), client, malform)
    with pytest.raises(TrainingError) as caught:
        loop.run()
    text = str(caught.value)
    assert "\n" not in text
    assert text.startswith(f"round 1: client {client} "), text
    assert re.search(message, text), text
    assert len(loop.history) == 1


def _assert_healthy(loop):
    """The global state is float32, finite and of honest magnitude."""
    server = loop.server
    tensors = (
        list(server.global_weights.values())
        if hasattr(server, "global_weights")
        else [server.global_means]
    )
    for tensor in tensors:
        if tensor.is_floating_point():
            assert tensor.dtype == torch.float32
            assert bool(torch.isfinite(tensor).all()) and float(tensor.abs().max()) < 100.0


@pytest.mark.parametrize("client", [0, 1])
@pytest.mark.parametrize(("method", "malform", "message"), list(_cases()))
def test_drop_completes_counts_and_never_poisons(method, malform, message, client):
    """drop: both rounds run, round 1 counts one drop (that client), the global state stays healthy."""
    loop = _inject(_loop(method(lr=0.05), on_invalid_upload="drop"), client, malform)
    loop.run()
    assert [r["comm/dropped_uploads"] for r in loop.history] == [0, 1]
    assert [(d["round"], d["client"]) for d in loop.dropped_uploads] == [(1, client)]
    _assert_healthy(loop)


def _control_in_float16(payload):
    return dataclasses.replace(payload, control={k: v.half() for k, v in payload.control.items()})


@pytest.mark.parametrize("policy", ["fail", "drop"])
def test_a_method_specific_field_is_screened_where_it_enters(policy):
    """SCAFFOLD's control variate in float16 from client 1 in round 1 (its weights are fine).

    fail: one line naming round 1, client 1 and the field; drop: the run completes without that
    upload and the server's ``c`` stays float32 (the check is the server's ``check_upload``, not
    a failure inside ``aggregate`` that would stop the run under both policies).
    """
    loop = _inject(_loop(SCAFFOLD(lr=0.05), on_invalid_upload=policy), 1, _control_in_float16)
    if policy == "fail":
        with pytest.raises(TrainingError, match=r"^round 1: client 1 sent 'control\.[\w.]+' as torch.float16 "):
            loop.run()
        return
    loop.run()
    assert [(d["round"], d["client"]) for d in loop.dropped_uploads] == [(1, 1)]
    controls = loop.server.state_by_architecture.values()
    assert {t.dtype for control in controls for t in control.values()} == {torch.float32}


def test_dropped_uploads_survive_a_checkpoint():
    """The list of dropped uploads is part of the checkpoint, so a resumed run keeps counting."""
    loop = _inject(_loop(FedAvg(lr=0.05), on_invalid_upload="drop"), 1, WEIGHT_MALFORMATIONS["nan"][0], at_round=0)
    loop.history.append(loop.run_round(0))
    loop.next_round = 1
    resumed = _loop(FedAvg(lr=0.05), on_invalid_upload="drop")
    resumed.load_checkpoint_state(loop.checkpoint_state())
    assert resumed.dropped_uploads == loop.dropped_uploads and len(resumed.dropped_uploads) == 1


def test_one_upload_per_round_is_enough_for_the_norm_bound():
    """Participation 1 (one upload a round): a x50 upload is still refused, naming client and round."""
    loop = _loop(FedAvg(lr=0.05), rounds=2, participation=1, upload_attack=UploadAttack(clients=[0, 1, 2]))
    with pytest.raises(TrainingError, match=r"^round 0: client \d sent weights 4\d(\.\d)?x the global model's norm"):
        loop.run()


def test_float16_upload_never_changes_the_global_dtype():
    """A float16 upload is refused, never averaged (weighted_average would cast the mean to it)."""
    loop = _inject(
        _loop(FedAvg(lr=0.05), on_invalid_upload="drop"), 0, WEIGHT_MALFORMATIONS["float16"][0], at_round=0
    )
    loop.run()
    assert {t.dtype for t in loop.server.global_weights.values() if t.is_floating_point()} == {torch.float32}


def test_relative_update_hand_values():
    """||u - g|| / ||g|| over the weights both carry: g = (3, 4) -> 5; u = (3, 4) + (0, 10) -> 2.0."""
    download = WeightsPayload(weights={"w": torch.tensor([3.0, 4.0]), "n": torch.tensor(7)})
    upload = WeightsPayload(weights={"w": torch.tensor([3.0, 14.0]), "n": torch.tensor(7)})
    assert relative_update(upload, download) == pytest.approx(2.0)
    assert relative_update(upload, None) is None
    prototypes = ClassStatsPayload(values=torch.ones(2, 2), counts=torch.tensor([1, 1]))
    assert relative_update(prototypes, ClassStatsPayload(values=torch.ones(2, 2), counts=torch.tensor([1, 1]))) is None


def test_honest_run_trips_no_default_bound_and_logs_its_margins():
    """Defaults on: an honest run is untouched, and the round records say how far below the bounds it was."""
    loop = _loop(FedAvg(lr=0.05))
    loop.run()
    for record in loop.history:
        assert record["comm/dropped_uploads"] == 0
        assert 0.0 < record["comm/max_update_ratio"] < 1.0
        assert 0.0 < record["comm/max_upload_value"] < 100.0


# ------------------------------------------------------------------ robust aggregation in the loop
def test_median_rule_takes_the_middle_upload_per_coordinate():
    """One of 3 clients sends its update reversed x4 (under the norm bound); the median rule is what is averaged."""
    attack = UploadAttack(clients=[2], kind="sign_flip", factor=4.0)
    median = _loop(FedAvg(lr=0.05), rounds=1, upload_attack=attack, aggregator=Aggregator(rule="median"))
    captured = {}
    original = median.server.aggregate

    def spy(round_idx, uploads):
        captured["uploads"] = [u.payload.weights for u in uploads]
        original(round_idx, uploads)

    median.server.aggregate = spy
    median.run()
    key = _first_key(median.server.global_weights)
    stacked = torch.stack([w[key] for w in captured["uploads"]])
    assert torch.equal(median.server.global_weights[key], stacked.median(dim=0).values)  # 3 clients: the middle one
    assert median.history[-1]["comm/dropped_uploads"] == 0


def test_robust_rule_refused_where_the_server_combines_its_own_way():
    """FedProto averages prototypes: a median rule is a one-line ConfigError at start-up."""
    with pytest.raises(ConfigError, match="combines uploads its own way"):
        _loop(FedProto(), aggregator=Aggregator(rule="median"))


def test_aggregator_settings_are_checked():
    """Bad rule, beta or m are one-line ConfigErrors."""
    with pytest.raises(ConfigError, match="rule='mode'"):
        Aggregator(rule="mode")
    with pytest.raises(ConfigError, match="beta=0.5"):
        Aggregator(rule="trimmed_mean", beta=0.5)
    with pytest.raises(ConfigError, match="m=0"):
        Aggregator(rule="krum", m=0)


# ------------------------------------------------------------------ from the command line
def test_command_line_names_the_poisoned_client_in_one_line(tmp_path, capsys):
    """The command line, client 1 sending 1e30: exit 3 (training stopped), one line naming round 0 and client 1.

    With ``on_invalid_upload: drop`` the run completes.
    """
    from fedhet.cli import main
    from fedhet.errors import EXIT_TRAINING_STOPPED
    from tests.conftest import tiny_overrides

    config = "configs/experiments/digits_dir/fedavg.yaml"
    shrink = [a for a in tiny_overrides("label_skew") if not a.startswith("--models")] + ["--models=cnn_tiny"]
    attack = ["--federation.upload_attack.clients=[1]", "--federation.upload_attack.kind=value",
              "--federation.upload_attack.factor=1e30", "--rounds=1", "--federation.aggregator.rule=median"]
    code = main(["fit", "--config", config, *shrink, *attack, f"--run_dir={tmp_path / 'fail'}"])
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == EXIT_TRAINING_STOPPED and "Traceback" not in err
    assert re.fullmatch(r"fedhet: error: round 0: client 1 sent a value of magnitude 1e\+30 .*", lines[-1]), lines
    code = main(["fit", "--config", config, *shrink, *attack, "--federation.on_invalid_upload=drop",
                 f"--run_dir={tmp_path / 'drop'}"])
    assert code == 0, capsys.readouterr().err
