"""How far apart generated images are: the unit of FedKTL's class-image diagnostics (the paper's Fig. 5).

Distances are root-mean-square over pixels, so they do not grow with the image size and read as
"a typical pixel differs by this much". A method divides them by the same distance between the
generator's images of random latents, so 0 means identical images and about 1 means as different
as random samples of the generator.
"""

from __future__ import annotations

import torch
from torch import Tensor


def mean_pairwise_rms(images: Tensor) -> Tensor:
    """Mean RMS pixel distance over the ordered pairs of different images of ``images`` ``[n, ...]``, ``n >= 2``.

    >>> import torch
    >>> images = torch.tensor([[0.0, 0.0], [3.0, 4.0], [0.0, 0.0]])
    >>> round(float(mean_pairwise_rms(images)), 4)   # pairs (0,1), (1,2): sqrt(25/2); pair (0,2): 0
    2.357
    """
    if images.shape[0] < 2:
        raise ValueError(f"mean_pairwise_rms needs at least two images, got {images.shape[0]}")
    flat = images.flatten(1).double()
    count, pixels = flat.shape
    # exact differences, not the |a|^2 + |b|^2 - 2ab shortcut (which loses the small distances)
    distances = torch.cdist(flat, flat, compute_mode="donot_use_mm_for_euclid_dist") / pixels**0.5
    return distances.sum() / (count * (count - 1))


def mean_rms_change(before: Tensor, after: Tensor) -> Tensor:
    """Mean over images of the RMS pixel change from ``before[i]`` to ``after[i]`` (both ``[n, ...]``).

    >>> import torch
    >>> round(float(mean_rms_change(torch.zeros(2, 2), torch.tensor([[3.0, 4.0], [0.0, 0.0]]))), 4)
    1.7678
    """
    if before.shape != after.shape:
        shapes = f"{tuple(before.shape)} and {tuple(after.shape)}"
        raise ValueError(f"mean_rms_change needs images of one shape, got {shapes}")
    return (after.double() - before.double()).flatten(1).pow(2).mean(-1).sqrt().mean()
