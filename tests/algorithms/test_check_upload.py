"""Every server checks every upload against its own expectations (issue 34): the registry-wide contract.

For every registered method whose server receives uploads, client 1's honest upload, taken from a
real one-round client step on the tiny scenario, passes ``server.check_upload``; the same upload
with one tensor of the wrong shape, one NaN, every floating tensor in float16, or a missing key
(field) is refused in one line that starts with ``client 1 sent`` and names the problem, so the
loop's ``federation.on_invalid_upload: drop`` drops it and blames the right client. The servers
are called directly (no rounds run), one short local step per method.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import pytest
import torch
from torch import Tensor

from fedhet.algorithms import ALGORITHMS
from fedhet.algorithms.base import ClientUpload, ServerPhase
from fedhet.core.payloads import Payload
from fedhet.errors import TrainingError
from fedhet.federation.runtime import ClientTask
from fedhet.federation.trainer import TrainerTemplate
from tests.algorithms.helpers import tiny_loop

#: Every method whose clients upload after local training (the lock-step methods exchange per batch instead).
UPLOADING = sorted(name for name, method in ALGORITHMS.items() if method.upload_type is not None)


def _first_floating(payload: Payload) -> str:
    return next(name for name, tensor in payload.tensors() if tensor.is_floating_point() and tensor.numel())


def _replace(payload: Payload, target: str, fn) -> Payload:
    return payload.map_tensors(lambda name, tensor: fn(tensor) if name == target else tensor)


def grown(payload: Payload) -> tuple[Payload, str]:
    """The first floating tensor one row longer (a scalar becomes a 1-vector)."""
    name = _first_floating(payload)

    def grow(t: Tensor) -> Tensor:
        return torch.zeros(1, dtype=t.dtype) if t.dim() == 0 else torch.cat([t, t[:1]])

    return _replace(payload, name, grow), name


def with_nan(payload: Payload) -> tuple[Payload, str]:
    """The first floating tensor with a NaN in its first entry."""
    name = _first_floating(payload)

    def poison(t: Tensor) -> Tensor:
        t = t.clone()
        t.view(-1)[0] = float("nan")
        return t

    return _replace(payload, name, poison), name


def in_float16(payload: Payload) -> tuple[Payload, str]:
    """Every floating tensor in float16 (another precision than the server's)."""
    return payload.map_tensors(lambda _, t: t.half() if t.is_floating_point() else t), "float16"


def missing(payload: Payload) -> tuple[Payload, str]:
    """The first key of the first non-empty dict field removed; without one, the last tensor field emptied."""
    fields = [f.name for f in dataclasses.fields(payload)]
    for field in fields:
        value = getattr(payload, field)
        if isinstance(value, Mapping) and value:
            key = next(iter(value))
            return dataclasses.replace(payload, **{field: {k: v for k, v in value.items() if k != key}}), key
    field = [f for f in fields if isinstance(getattr(payload, f), Tensor) and getattr(payload, f).numel()][-1]
    return dataclasses.replace(payload, **{field: torch.zeros(0)}), field


MALFORMATIONS = {"shape": grown, "nan": with_nan, "float16": in_float16, "missing": missing}


@functools.cache
def honest_upload(name: str) -> tuple[ServerPhase, ClientUpload]:
    """``(server, client 1's honest upload)`` of method ``name`` after one short local step in round 0."""
    loop = tiny_loop(name, rounds=1, trainer=TrainerTemplate(max_epochs=1, max_steps=2, accelerator="cpu"))
    step_idx = next(i for i, step in enumerate(loop.schedule) if step.is_round)
    task = ClientTask(1, 0, loop.store.get(1), loop.server.download_for(1), step_idx=step_idx)
    payload = loop.runtime.fit_client(task).upload
    assert isinstance(payload, loop.algorithm.upload_type)
    loop.server.phase = loop.schedule[step_idx].phase
    return loop.server, ClientUpload(1, loop.architectures[1], payload)


@pytest.fixture(params=UPLOADING)
def honest(request):
    """Every uploading method's server and client 1's honest upload (built once per method)."""
    server, upload = honest_upload(request.param)
    server.phase = "federation"
    return server, upload


def test_an_honest_upload_passes(honest):
    """What a real client step sends is what its server expects (keys, shapes, dtypes, counts)."""
    server, upload = honest
    server.check_upload(upload)


@pytest.mark.parametrize("kind", sorted(MALFORMATIONS))
def test_a_malformed_upload_is_refused_naming_client_1(honest, kind):
    """One line, ``client 1 sent ...``, naming the malformed field (or float16)."""
    server, upload = honest
    payload, named = MALFORMATIONS[kind](upload.payload)
    with pytest.raises(TrainingError) as caught:
        server.check_upload(dataclasses.replace(upload, payload=payload))
    text = str(caught.value)
    assert text.startswith("client 1 sent ") and "\n" not in text, text
    assert named in text, text


def test_a_wrong_payload_type_and_a_negative_count_are_refused(honest):
    """Another payload type, and a negative example count, name client 1 too."""
    server, upload = honest
    with pytest.raises(TrainingError, match=r"^client 1 sent Payload, expected "):
        server.check_upload(dataclasses.replace(upload, payload=Payload(num_examples=3)))
    with pytest.raises(TrainingError, match=r"^client 1 sent a negative example count \(-1\)"):
        server.check_upload(dataclasses.replace(upload, payload=dataclasses.replace(upload.payload, num_examples=-1)))


# ------------------------------------------------------------------ method-specific expectations
def _refused(server, upload, payload, pattern):
    with pytest.raises(TrainingError, match=pattern):
        server.check_upload(dataclasses.replace(upload, payload=payload))


@pytest.mark.parametrize("name", ["fedgen", "fedmdcg", "ccvr", "fedktl", "fedproc"])
def test_counts_above_what_the_client_holds_are_refused(name):
    """Counts are checked against ServerContext.label_counts (client 1's own), not only their sign."""
    server, upload = honest_upload(name)
    field = "label_counts" if hasattr(upload.payload, "label_counts") else "counts"
    counts = getattr(upload.payload, field)
    above = dataclasses.replace(upload.payload, **{field: counts + 10_000})
    _refused(server, upload, above, r"^client 1 sent (label|class) counts inconsistent with its data \(class 0: ")
    int32 = dataclasses.replace(upload.payload, **{field: counts.int()})
    message = r"^client 1 sent invalid (label|class) counts \(must be non-negative integers, int64\)"
    _refused(server, upload, int32, message)


def test_fedkd_refuses_an_energy_outside_0_1_and_a_rank_above_min_m_n():
    """An energy of 1.5; a factorised matrix's s one entry longer than min(m, n) (u and v consistent with it)."""
    server, upload = honest_upload("fedkd")
    _refused(server, upload, dataclasses.replace(upload.payload, energy=1.5), r"^client 1 sent an SVD energy of 1\.5")
    name, factors = next(iter(upload.payload.low_rank.items()))
    rows, cols = factors["u"].shape[0], factors["v"].shape[1]
    k = min(rows, cols) + 1
    big = {"u": torch.zeros(rows, k), "s": torch.ones(k), "v": torch.zeros(k, cols)}
    low_rank = {**upload.payload.low_rank, name: big}
    _refused(server, upload, dataclasses.replace(upload.payload, low_rank=low_rank),
             rf"^client 1 sent 'low_rank\.{name}\.s' of shape \({k},\), expected a rank between 1 and {k - 1}")


def test_fedvtc_expects_what_the_phase_sends():
    """In vtc_sync the VTC is required; while fine-tuning nothing is expected; classes must be held."""
    server, upload = honest_upload("fedvtc")
    assert not upload.payload.vtc  # psi_sync="once": rounds send no VTC
    server.phase = "vtc_sync"
    _refused(server, upload, upload.payload, r"^client 1 sent no 'vtc', which every upload of phase 'vtc_sync' holds")
    server.phase = "finetune"
    _refused(server, upload, upload.payload, r"^client 1 sent VTCPayload during fine-tuning, where clients send no")
    server.phase = "federation"
    held = server.owned[1].clone()
    try:
        first = int(upload.payload.classes[0])
        server.owned[1, first] = False
        _refused(server, upload, upload.payload, rf"^client 1 sent a prototype of class {first}, which it holds no")
    finally:
        server.owned[1] = held
