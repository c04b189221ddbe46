"""Simulated poisoning clients, for robustness studies and tests (``federation.upload_attack``).

The loop replaces the uploads of the listed clients after they made them (and after any
privacy noise), exactly where a malicious client would send something else, so every defence
downstream sees them as it would in a deployment: the checks and bounds of
:meth:`FederationLoop._screen_uploads <fedhet.federation.FederationLoop>` and the aggregation
rule (:mod:`fedhet.federation.aggregation`). Attacks, on every floating tensor ``w`` of the
upload, with ``g`` the same tensor of the client's download (zero when there is none):

* ``scale``: ``factor * w`` (model scaling / replacement; ``factor = 50``);
* ``sign_flip``: ``g - factor * (w - g)``, the honest update reversed and amplified (the
  "sign-flipping" attack of the Byzantine-robustness literature, e.g. Karimireddy et al. 2021);
* ``value``: every value set to ``factor`` (``1e30``: a finite absurd upload).

Integer tensors (class counts, ``num_batches_tracked``) are left as the client made them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from fedhet.core.payloads import Payload
from fedhet.errors import ConfigError

AttackKind = Literal["scale", "sign_flip", "value"]


@dataclass(frozen=True)
class UploadAttack:
    """What the malicious clients send instead of their honest upload.

    Args:
        clients: ids of the malicious clients (they attack in every round they take part in).
        kind: ``"scale"``, ``"sign_flip"`` or ``"value"`` (see the module).
        factor: the scale, the amplification of the reversed update, or the value.
    """

    clients: Sequence[int] = field(default_factory=tuple)
    kind: AttackKind = "scale"
    factor: float = 50.0

    def __post_init__(self) -> None:
        if self.kind not in ("scale", "sign_flip", "value"):
            raise ConfigError(f"federation.upload_attack.kind={self.kind!r}: use 'scale', 'sign_flip' or 'value'")
        if any(int(c) < 0 for c in self.clients):
            raise ConfigError(f"federation.upload_attack.clients={list(self.clients)}: client ids are >= 0")

    def attacks(self, client_id: int) -> bool:
        """Whether ``client_id`` is malicious."""
        return client_id in {int(c) for c in self.clients}

    def poison(self, payload: Payload, download: Payload | None) -> Payload:
        """The malicious version of ``payload`` (``download``: what the client received, if anything)."""
        received = dict(download.tensors()) if download is not None else {}

        def attack(name: str, tensor: Tensor) -> Tensor:
            if not tensor.is_floating_point():
                return tensor
            if self.kind == "scale":
                return tensor * self.factor
            if self.kind == "value":
                return torch.full_like(tensor, self.factor)
            start = received.get(name)
            start = start.to(tensor) if start is not None and start.shape == tensor.shape else torch.zeros_like(tensor)
            return start - self.factor * (tensor - start)

        return payload.map_tensors(attack)
