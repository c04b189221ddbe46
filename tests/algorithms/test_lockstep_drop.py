"""A lock-step participant whose exchanged outputs are invalid is left out, exactly, under ``drop``.

FedMD, FedDF, RHFL and FedMatch exchange logits batch by batch (FCCL and FCCL+ their logits and
similarities, checked here through FCCL+); there is no per-round upload for the loop to drop, so
the phase itself checks what each participant is about to send. Under
``federation.on_invalid_upload: drop`` a participant whose logits are invalid (here: NaN or 1e30,
from its head bias) is left out of that batch and the rest of the phase: nobody's target contains
its logits and it takes no step. The strongest statement of "exactly" is numeric: the others end
where a phase without that participant ends. Under ``fail`` the same participant stops the run
with one line naming it; in a run, the loop counts the drop against the right client in
``summary.json``.
"""

from __future__ import annotations

import math

import pytest
import torch

from fedhet.algorithms import RHFL, FCCLPlus, FedDF, FedMatch, FedMD
from fedhet.algorithms.shared.common import PublicLogitsPayload
from fedhet.errors import TrainingError
from tests.algorithms.helpers import tiny_loop
from tests.algorithms.oracle import TinyBNNet, assert_states_close, batch, clone, collaborative_step, unlabelled_loader

M, CHANNELS, B = 4, 1, 6
LOCAL = {"optimizer": "sgd", "lr": 0.1, "weight_decay": 0.0}
METHODS = {
    "fedmd": lambda: FedMD(public_optimizer="sgd", public_lr=0.1, **LOCAL),
    "feddf": lambda: FedDF(public_lr=0.1, temperature=2.0, **LOCAL),
    "rhfl": lambda: RHFL(public_optimizer="sgd", public_lr=0.1, **LOCAL),
    "fedmatch": lambda: FedMatch(public_optimizer="sgd", public_lr=0.1, **LOCAL),
    "fccl_plus": lambda: FCCLPlus(**LOCAL),  # the cross-correlation phase (FCCL's too): logits and similarities
}


#: what a poisoned participant's head bias holds, and the words its refusal must contain
POISONS = {"nan": (float("nan"), "non-finite"), "1e30": (1e30, "magnitude 1e+30 (bound 1e+06)")}


def _clients(algorithm, seeds, poisoned=(), poison="nan"):
    clients = [algorithm.build_client(TinyBNNet(CHANNELS, M, seed=seed), M) for seed in seeds]
    for index in poisoned:
        with torch.no_grad():
            clients[index].model.head.bias.fill_(POISONS[poison][0])
    return clients


def _public():
    return unlabelled_loader([batch(50 + i, size=B)[0] for i in range(2)])


@pytest.mark.parametrize("poison", sorted(POISONS))
@pytest.mark.parametrize("name", sorted(METHODS))
def test_a_dropped_participant_is_as_if_it_never_took_part(name, poison):
    """Three participants, the middle one with NaN (or 1e30) logits: the others end as in a two-participant phase."""
    algorithm = METHODS[name]()
    clients = _clients(algorithm, [10, 11, 12], poisoned=[1], poison=poison)
    before = {k: v.clone() for k, v in clients[1].named_parameters()}
    phase = collaborative_step(algorithm, clients, _public(), drop_invalid=True, value_bound=1e6)
    assert list(phase.dropped) == [1] and "participant 1" in phase.dropped[1] and POISONS[poison][1] in phase.dropped[1]

    reference = _clients(algorithm, [10, 12])
    collaborative_step(algorithm, reference, _public())
    for mine, theirs in ((0, 0), (2, 1)):
        state = clone(reference[theirs].client_state())
        assert_states_close(clients[mine].client_state(), state, f"{name} participant {mine}")
    for key, value in clients[1].named_parameters():  # no step (its BatchNorm saw the first batch's forward)
        assert torch.equal(value.isnan(), before[key].isnan()), key
        assert torch.equal(value.nan_to_num(), before[key].nan_to_num()), key


@pytest.mark.parametrize("name", sorted(METHODS))
def test_without_drop_the_invalid_participant_stops_the_phase_by_name(name):
    """Under ``fail`` (the default) the phase stops with one line naming the participant."""
    algorithm = METHODS[name]()
    with pytest.raises(TrainingError, match="participant 1 sent non-finite values"):
        collaborative_step(algorithm, _clients(algorithm, [10, 11, 12], poisoned=[1]), _public())


def test_the_loop_counts_a_dropped_exchange_against_its_client(monkeypatch, cpu_trainer):
    """In a FedMD run under drop, client 1's refused logits are counted in summary.json, and the run completes."""
    original = PublicLogitsPayload.validate_shape

    def refuse_participant_1(self, batch_size, num_classes, sender="client"):
        if sender == "participant 1":
            raise TrainingError(f"{sender} sent logits of a refused shape (test)")
        original(self, batch_size, num_classes, sender)

    monkeypatch.setattr(PublicLogitsPayload, "validate_shape", refuse_participant_1)
    loop = tiny_loop("fedmd", "label_skew", trainer=cpu_trainer, rounds=2, on_invalid_upload="drop")
    summary = loop.run()
    assert summary["dropped_uploads"] == {"total": 2, "per_client": {"1": 2}}
    assert [(d["round"], d["client"]) for d in loop.dropped_uploads] == [(0, 1), (1, 1)]
    assert all(math.isfinite(summary["final"][k]) for k in ("acc_local", "acc_global"))
    with pytest.raises(TrainingError, match="participant 1 sent logits of a refused shape"):
        tiny_loop("fedmd", "label_skew", trainer=cpu_trainer, rounds=1).run()
