"""The GAN losses of StyleGAN2's recipe, and the generator's moving average: pure tensor functions.

:mod:`fedhet.generators.pretrain` trains FedKTL's small style generator with them: the logistic
discriminator loss, the non-saturating generator loss (Goodfellow et al., 2014), the lazy R1
penalty on real images (Mescheder et al., 2018) and an exponential moving average of the
generator's weights (StyleGAN's ``G_ema``). Each is checked against hand-computed values in
``tests/functional/test_gan.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["discriminator_logistic_loss", "ema_update", "generator_nonsaturating_loss", "r1_penalty"]


def discriminator_logistic_loss(real_logits: Tensor, fake_logits: Tensor) -> Tensor:
    """``mean softplus(-D(x)) + mean softplus(D(G(z)))``: the discriminator's logistic GAN loss."""
    return F.softplus(-real_logits).mean() + F.softplus(fake_logits).mean()


def generator_nonsaturating_loss(fake_logits: Tensor) -> Tensor:
    """``mean softplus(-D(G(z)))``: the non-saturating generator loss (Goodfellow et al., 2014)."""
    return F.softplus(-fake_logits).mean()


def r1_penalty(real_logits: Tensor, real_images: Tensor) -> Tensor:
    """``mean_i ||d D(x_i) / d x_i||^2`` over the batch (Mescheder et al., 2018), differentiable.

    ``real_images`` must require grad and ``real_logits`` must be computed from them.
    """
    (gradients,) = torch.autograd.grad(real_logits.sum(), real_images, create_graph=True)
    return gradients.square().sum(dim=tuple(range(1, gradients.ndim))).mean()


@torch.no_grad()
def ema_update(average: nn.Module, current: nn.Module, decay: float) -> None:
    """``average <- decay * average + (1 - decay) * current``, parameter by parameter (buffers copied)."""
    for averaged, value in zip(average.parameters(), current.parameters(), strict=False):
        averaged.lerp_(value, 1.0 - decay)
    for averaged, value in zip(average.buffers(), current.buffers(), strict=False):
        averaged.copy_(value)
