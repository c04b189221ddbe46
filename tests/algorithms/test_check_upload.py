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
from collections.abc import Mapping

import pytest
import torch
from torch import Tensor

from fedhet.algorithms import ALGORITHMS
from fedhet.algorithms.base import ClientUpload
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


@pytest.fixture(scope="module", params=UPLOADING)
def honest(request):
    """``(server, client 1's honest upload)`` after one short local step in the first federated round."""
    loop = tiny_loop(request.param, rounds=1, trainer=TrainerTemplate(max_epochs=1, max_steps=2, accelerator="cpu"))
    step_idx = next(i for i, step in enumerate(loop.schedule) if step.is_round)
    task = ClientTask(1, 0, loop.store.get(1), loop.server.download_for(1), step_idx=step_idx)
    payload = loop.runtime.fit_client(task).upload
    assert isinstance(payload, loop.algorithm.upload_type)
    loop.server.phase = loop.schedule[step_idx].phase
    return loop.server, ClientUpload(1, loop.architectures[1], payload)


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
