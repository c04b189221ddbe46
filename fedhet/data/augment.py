"""Batched tensor augmentations.

Every augmentation acts on a whole float batch ``[B, C, H, W]`` (values in ``[0, 1]``, before
normalisation) and draws its randomness from a ``torch.Generator`` passed in by the caller.
Doing one tensor op per batch instead of one PIL call per sample is what keeps client
training fast (design section 3), and taking the generator explicitly is what makes a batch's
augmentation a pure function of ``(seed, epoch, batch index)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["BatchAugment", "Compose", "RandomCropPad", "RandomHorizontalFlip"]


@runtime_checkable
class BatchAugment(Protocol):
    """A random transform of a whole float image batch."""

    def __call__(self, images: Tensor, generator: torch.Generator) -> Tensor:
        """Return an augmented copy of ``images`` ``[B, C, H, W]`` using only ``generator``."""
        ...


class RandomCropPad:
    """Zero-pad every side by ``padding`` pixels, then crop back to the original size.

    The per-sample offsets are drawn independently, as torchvision's
    ``RandomCrop(size, padding=padding)`` does one image at a time. Padding with zeros before
    normalisation matches torchvision, which pads the ``[0, 1]`` image with black.

    Args:
        padding: pixels of zero padding on each side; the crop offset is uniform in
            ``[0, 2 * padding]`` along each axis.
    """

    def __init__(self, padding: int = 4) -> None:
        if padding < 0:
            raise ValueError(f"padding must be >= 0, got {padding}")
        self.padding = padding

    def __call__(self, images: Tensor, generator: torch.Generator) -> Tensor:
        """Return ``images`` randomly shifted by up to ``padding`` pixels, zero-filled."""
        if self.padding == 0 or images.shape[0] == 0:
            return images
        batch, channels, height, width = images.shape
        pad = self.padding
        padded_width = width + 2 * pad
        padded = F.pad(images, (pad, pad, pad, pad)).reshape(batch, channels, -1)
        offsets = torch.randint(0, 2 * pad + 1, (2, batch), generator=generator)
        offsets = offsets.to(images.device)
        # Flat index of every output pixel inside its padded image: one gather does the crop
        # for the whole batch (5x faster than advanced indexing on CPU).
        rows = torch.arange(height, device=images.device)[:, None] * padded_width
        window = (rows + torch.arange(width, device=images.device)[None, :]).reshape(1, -1)
        flat_index = (offsets[0] * padded_width + offsets[1])[:, None] + window  # [B, H*W]
        cropped = padded.gather(2, flat_index[:, None, :].expand(batch, channels, -1))
        return cropped.reshape(batch, channels, height, width)

    def __repr__(self) -> str:
        return f"RandomCropPad(padding={self.padding})"


class RandomHorizontalFlip:
    """Mirror each image left-right with probability ``p``, independently per sample.

    Args:
        p: probability that a given image is flipped.
    """

    def __init__(self, p: float = 0.5) -> None:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be in [0, 1], got {p}")
        self.p = p

    def __call__(self, images: Tensor, generator: torch.Generator) -> Tensor:
        """Return ``images`` with a random subset of samples flipped along the width axis."""
        if images.shape[0] == 0:
            return images
        flip = torch.rand(images.shape[0], generator=generator) < self.p
        flip = flip.to(images.device)[:, None, None, None]
        return torch.where(flip, images.flip(-1), images)

    def __repr__(self) -> str:
        return f"RandomHorizontalFlip(p={self.p})"


class Compose:
    """Apply several batch augmentations in order, all drawing from the same generator.

    Args:
        augments: the augmentations, applied first to last.
    """

    def __init__(self, augments: Sequence[BatchAugment]) -> None:
        self.augments = list(augments)

    def __call__(self, images: Tensor, generator: torch.Generator) -> Tensor:
        """Return ``images`` passed through every augmentation in order."""
        for augment in self.augments:
            images = augment(images, generator)
        return images

    def __repr__(self) -> str:
        return f"Compose({self.augments!r})"
