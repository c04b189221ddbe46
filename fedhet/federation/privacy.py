"""Gaussian perturbation of what crosses the network, for privacy studies (FedKTL App. Table 10).

FedKTL evaluates its robustness to noisy prototypes ("NC") and noisy generated image-vector
pairs ("NG") with FedPCL's perturbation: every transmitted value ``x`` becomes
``x + p * n`` with ``n ~ N(0, s^2)``, where ``s`` is the noise scale and ``p`` the perturbation
coefficient; FedPCL (and FedKTL after it) use ``(s, p) = (0.05, 0.2)`` for vectors and
prototypes and ``(0.2, 0.2)`` for images.

This is a loop option any method gets for free (``federation.upload_noise`` and
``federation.download_noise``), not code inside a method: the loop perturbs every floating
tensor of an upload after the client made it and of a download before the client applies it.
Tensors with three or more dimensions (image batches) use the image setting, everything else
(vectors, prototypes, weights, logits) the vector setting. Integer tensors (class counts) are
never perturbed. The noise of each (round, client, direction) comes from its own seed, so runs
are reproducible and independent of client order. Communication is measured on the perturbed
payload, which has the same size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fedhet.core.payloads import Payload
from fedhet.errors import ConfigError


@dataclass(frozen=True)
class PayloadNoise:
    """FedPCL-style Gaussian perturbation ``x + p * N(0, s^2)`` of transmitted tensors.

    Args:
        scale: noise standard deviation ``s`` for vectors (prototypes, latents, weights, logits).
        coefficient: perturbation coefficient ``p`` for vectors.
        image_scale: ``s`` for tensors with 3 or more dimensions (images).
        image_coefficient: ``p`` for images.
    """

    scale: float = 0.05
    coefficient: float = 0.2
    image_scale: float = 0.2
    image_coefficient: float = 0.2

    def __post_init__(self) -> None:
        for name in ("scale", "coefficient", "image_scale", "image_coefficient"):
            if getattr(self, name) < 0:
                raise ConfigError(f"noise {name}={getattr(self, name)} must be >= 0")

    def std_for(self, tensor: Tensor) -> float:
        """Standard deviation of the noise added to ``tensor`` (``p * s`` of its kind)."""
        if tensor.dim() >= 3:
            return self.image_coefficient * self.image_scale
        return self.coefficient * self.scale

    def perturb(self, payload: Payload, seed: int) -> Payload:
        """A copy of ``payload`` with every floating tensor perturbed (deterministic in ``seed``)."""
        generator = torch.Generator().manual_seed(seed)

        def add_noise(_: str, tensor: Tensor) -> Tensor:
            std = self.std_for(tensor)
            if not tensor.is_floating_point() or std == 0:
                return tensor
            noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
            return tensor + (std * noise).to(device=tensor.device, dtype=tensor.dtype)

        return payload.map_tensors(add_noise)
