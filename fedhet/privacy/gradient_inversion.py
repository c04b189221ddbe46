"""A gradient-inversion attack on what each method uploads (DLG / inverting gradients), scored by PSNR.

FedMD-CG's Table 2 runs Deep Leakage from Gradients (Zhu et al., NeurIPS 2019) as a malicious
server on each method's upload and reports the PSNR of the reconstructions; the paper does not
say which gradients are attacked (spec ``reference/fedmdcg.md`` section 5). The setting here:

* the victim takes one training step on one private image ``(x, y)`` with its full model
  ``[F_i, D_i]`` (and, for the generator methods, its generator ``G_i``); the server observes the
  gradient of the parameters the method *uploads* (:data:`UPLOADED_PARTS`): everything (FedAvg),
  the extractor (FedPer), the classifier (LG-FedAvg), the classifier and the generator (FedCG,
  FedMD-CG: the classifier's CE gradient and the generator's stage-2 gradient). Each generator
  method's own stage 2: FedMD-CG's mimicry gradient ``d/dw ||G_i(z, y) - F_i(x)||^2``; FedCG's
  adversarial gradient ``d/dw -log s'(G_i(z, y), y)``, where ``s'`` is the latent discriminator
  after its step on the real features ``F_i(x)`` (:func:`fedcg_generator_gradients`), so ``x``
  reaches FedCG's generator upload only through that one discriminator step;
* the attacker knows the architecture, the true label and the noise ``z`` (a strong attacker).
  By default it also holds the victim's whole model (DLG's white-box assumption), so methods
  differ only in *which gradients* they reveal; with ``guess`` it holds only what was uploaded
  and replaces the parts that never leave the client (FedPer's head, the private extractors of
  LG-FedAvg, FedCG and FedMD-CG) by an independently initialised copy;
* it optimises a dummy image with Adam to match the observed gradients by cosine distance over
  all uploaded tensors plus a total-variation prior (Geiping et al., "Inverting Gradients",
  NeurIPS 2020, the stronger successor of DLG's L2 matching);
* PSNR is computed on the de-normalised images clamped to ``[0, 1]``.

Reference rows (:func:`reference_psnrs`): the PSNR of reconstructions that use no gradient at
all, an all-black image, the training set's mean image, and the attack's untouched starting
dummy, scored by the same :func:`psnr` on the same clamped images. A method's number means
leakage only by its distance above these floors.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Method = Literal["fedavg", "fedper", "lg_fedavg", "fedcg", "fedmdcg"]

#: What each method uploads: ``(model parts, generator uploaded)``; parts are ``"extractor"``
#: (everything outside ``head``) and ``"head"``.
UPLOADED_PARTS: dict[str, tuple[tuple[str, ...], bool]] = {
    "fedavg": (("extractor", "head"), False),
    "fedper": (("extractor",), False),
    "lg_fedavg": (("head",), False),
    "fedcg": (("head",), True),
    "fedmdcg": (("head",), True),
}


def _part(name: str) -> str:
    return "head" if name.startswith("head.") else "extractor"


#: The discriminator's step size in FedCG's modelled stage 2: FedCG's Adam learning rate (3e-4).
FEDCG_DISCRIMINATOR_LR = 3e-4


def fedcg_generator_gradients(
    generator: nn.Module,
    discriminator: nn.Module,
    features: Tensor,
    y: Tensor,
    noise: Tensor,
    discriminator_lr: float = FEDCG_DISCRIMINATOR_LR,
    create_graph: bool = False,
) -> dict[str, Tensor]:
    """FedCG's generator gradient of one stage-2 step on real features ``features = F(x)``.

    As FedCG's client step (``fedhet.algorithms.fedcg``): the discriminator ``s(h, y)`` first
    steps on ``L_disc = BCE(s(F(x), y), 1) + BCE(s(G(z, y), y), 0)`` (``G`` detached), then the
    generator's gradient is that of ``BCE(s'(G(z, y), y), 1)`` under the stepped ``s'``. The
    discriminator's Adam step is modelled as an SGD step of the same learning rate: Adam's first
    step ``lr * sign(g)`` depends on ``x`` only piecewise-constantly, so the SGD step is the more
    informative one for an attacker. Keys are ``generator.<name>``.
    """
    from torch.func import functional_call

    generated, _ = generator(y, noise)
    params = dict(discriminator.named_parameters())
    real = discriminator(features, y)
    fake = discriminator(generated.detach(), y)
    loss_d = F.binary_cross_entropy(real, torch.ones_like(real)) + F.binary_cross_entropy(fake, torch.zeros_like(fake))
    grads_d = torch.autograd.grad(loss_d, list(params.values()), create_graph=True)
    stepped = {name: p - discriminator_lr * g for (name, p), g in zip(params.items(), grads_d, strict=True)}
    score = functional_call(discriminator, stepped, (generated, y))
    loss_g = F.binary_cross_entropy(score, torch.ones_like(score))
    named = [(f"generator.{n}", p) for n, p in generator.named_parameters()]
    grads = torch.autograd.grad(loss_g, [p for _, p in named], create_graph=create_graph)
    return dict(zip([n for n, _ in named], grads, strict=True))


def uploaded_gradients(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    method: str,
    generator: nn.Module | None = None,
    noise: Tensor | None = None,
    create_graph: bool = False,
    discriminator: nn.Module | None = None,
) -> dict[str, Tensor]:
    """The gradients of one training step on ``(x, y)`` that ``method``'s upload reveals.

    Keys are ``model.<name>`` and ``generator.<name>``. The model's gradient is the CE gradient;
    FedMD-CG's generator gradient is the stage-2 mimicry gradient of ``||G(z, y) - F(x)||^2``
    (mean), whose target ``F(x)`` depends on the private image; FedCG's is its adversarial
    gradient (:func:`fedcg_generator_gradients`; pass the client's ``discriminator``).
    """
    if method not in UPLOADED_PARTS:
        raise ValueError(f"unknown method {method!r}; use one of {', '.join(UPLOADED_PARTS)}")
    parts, with_generator = UPLOADED_PARTS[method]
    features = model.forward_features(x)
    loss = F.cross_entropy(model.forward_head(features), y)
    named = [(f"model.{n}", p) for n, p in model.named_parameters() if _part(n) in parts]
    grads = torch.autograd.grad(loss, [p for _, p in named], create_graph=create_graph)
    out = dict(zip([n for n, _ in named], grads, strict=True))
    if with_generator:
        if generator is None or noise is None:
            raise ValueError(f"{method} uploads a generator: pass generator and noise")
        if method == "fedcg":
            if discriminator is None:
                raise ValueError("fedcg's generator gradient is adversarial: pass the client's discriminator")
            adversarial = fedcg_generator_gradients(
                generator, discriminator, features, y, noise, create_graph=create_graph
            )
            out.update(adversarial)
            return out
        generated, _ = generator(y, noise)
        mimicry = F.mse_loss(generated, features)
        gen_named = [(f"generator.{n}", p) for n, p in generator.named_parameters()]
        gen_grads = torch.autograd.grad(mimicry, [p for _, p in gen_named], create_graph=create_graph)
        out.update(zip([n for n, _ in gen_named], gen_grads, strict=True))
    return out


def total_variation(images: Tensor) -> Tensor:
    """Mean absolute difference of neighbouring pixels (the image prior of inverting gradients)."""
    return (images[..., 1:, :] - images[..., :-1, :]).abs().mean() + (
        images[..., :, 1:] - images[..., :, :-1]
    ).abs().mean()


def psnr(reconstruction: Tensor, original: Tensor, data_range: float = 1.0) -> float:
    """Peak signal-to-noise ratio in dB, ``10 log10(range^2 / MSE)`` (capped at 100 dB for identity)."""
    mse = float(F.mse_loss(reconstruction.float(), original.float()))
    return 100.0 if mse <= 1e-10 else 10.0 * math.log10(data_range**2 / mse)


@dataclass(frozen=True)
class InversionResult:
    """A reconstruction, its PSNR (dB) against the original, and the final matching loss."""

    reconstruction: Tensor
    psnr: float
    matching_loss: float


Knowledge = Literal["whole_model", "uploads_only"]


def _attacker_view(victim: nn.Module, method: str, guess: nn.Module | None) -> nn.Module:
    """The victim's network as the attacker holds it: private parts replaced by ``guess`` when given."""
    parts, _ = UPLOADED_PARTS[method]
    attacker = copy.deepcopy(victim)
    if guess is None:
        return attacker
    own = dict(guess.state_dict())
    with torch.no_grad():
        for name, tensor in attacker.state_dict().items():
            if _part(name) not in parts:  # never sent: the attacker only has its guess
                tensor.copy_(own[name])
    return attacker


def invert_gradients(
    victim: nn.Module,
    x: Tensor,
    y: Tensor,
    method: str,
    denormalize: Callable[[Tensor], Tensor],
    guess: nn.Module | None = None,
    generator: nn.Module | None = None,
    noise: Tensor | None = None,
    steps: int = 300,
    lr: float = 0.1,
    tv_weight: float = 1e-2,
    seed: int = 0,
    discriminator: nn.Module | None = None,
    guess_discriminator: nn.Module | None = None,
) -> InversionResult:
    """Reconstruct ``x`` from the gradients ``method`` uploads after one step on ``(x, y)``.

    Args:
        victim: the client's full model (``forward_features`` / ``forward_head``), eval mode.
        x: the private image(s) ``[B, C, H, W]`` (normalised as the client sees them).
        y: their labels (known to the attacker).
        method: a key of :data:`UPLOADED_PARTS`.
        denormalize: maps normalised images back to ``[0, 1]`` for the PSNR.
        guess: ``None``: the attacker holds the victim's whole model (DLG's white-box assumption,
            under which only *which gradients are observed* differs between methods: the
            setting of FedMD-CG's Table 2); a model of the same architecture: the parameters
            the method never uploads are replaced by it (the attacker sees uploads only).
        generator: the victim's generator (generator methods only).
        noise: the generator's noise for ``y`` (known to the attacker).
        steps: Adam steps of the attack.
        lr: Adam learning rate on the dummy image.
        tv_weight: weight of the total-variation prior.
        seed: seed of the dummy image (:func:`initial_dummy`; ``steps=0`` scores it untouched).
        discriminator: FedCG's latent discriminator of the victim (``method="fedcg"`` only).
        guess_discriminator: the attacker's own discriminator when it holds the uploads only
            (FedCG's discriminator never leaves the client); ``None``: the victim's, as with
            ``guess=None``.
    """
    victim = victim.eval()
    observed = {
        k: g.detach()
        for k, g in uploaded_gradients(victim, x, y, method, generator, noise, discriminator=discriminator).items()
    }
    attacker = _attacker_view(victim, method, guess).eval()
    attacker_generator = copy.deepcopy(generator).eval() if generator is not None else None  # uploaded
    held = guess is not None and guess_discriminator is not None
    attacker_discriminator = guess_discriminator if held else discriminator  # FedCG's s is never uploaded
    dummy = initial_dummy(x.shape, seed).requires_grad_(True)
    optimizer = torch.optim.Adam([dummy], lr=lr)
    matching = float("nan")
    for _ in range(steps):
        optimizer.zero_grad()
        grads = uploaded_gradients(
            attacker, dummy, y, method, attacker_generator, noise, create_graph=True,
            discriminator=attacker_discriminator,
        )
        dot = sum((grads[k] * observed[k]).sum() for k in observed)
        norm_a = torch.sqrt(sum(grads[k].pow(2).sum() for k in observed))
        norm_b = math.sqrt(sum(float(observed[k].pow(2).sum()) for k in observed))
        loss = 1.0 - dot / (norm_a * norm_b + 1e-12) + tv_weight * total_variation(dummy)
        loss.backward()
        optimizer.step()
        matching = float(loss.detach())
    with torch.no_grad():
        reconstruction = denormalize(dummy.detach()).clamp(0.0, 1.0)
        original = denormalize(x).clamp(0.0, 1.0)
    return InversionResult(reconstruction, psnr(reconstruction, original), matching)


def initial_dummy(shape: torch.Size | tuple[int, ...], seed: int) -> Tensor:
    """The attack's starting image: ``N(0, 1)`` in the normalised space, from ``seed``."""
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed))


def reference_psnrs(
    x: Tensor, denormalize: Callable[[Tensor], Tensor], dataset_mean: Tensor, seed: int = 0
) -> dict[str, float]:
    """PSNR (dB) of three gradient-free "reconstructions" of ``x``, scored as the attack's are.

    * ``all_black``: an all-zero image in ``[0, 1]``;
    * ``dataset_mean``: ``dataset_mean``, the training images' per-pixel mean in ``[0, 1]``
      (``[C, H, W]`` or ``[1, C, H, W]``);
    * ``untouched_dummy``: :func:`initial_dummy` with ``seed``, de-normalised and clamped, the
      image the attack starts from (what ``invert_gradients(..., steps=0)`` returns).

    A method's PSNR shows leakage only by how far it lies above these.
    """
    original = denormalize(x).clamp(0.0, 1.0)
    mean_image = dataset_mean.reshape(1, *original.shape[1:]).expand_as(original).clamp(0.0, 1.0)
    dummy = denormalize(initial_dummy(x.shape, seed)).clamp(0.0, 1.0)
    return {
        "all_black": psnr(torch.zeros_like(original), original),
        "dataset_mean": psnr(mean_image, original),
        "untouched_dummy": psnr(dummy, original),
    }


def denormalizer(mean: Mapping[int, float] | tuple[float, ...], std: tuple[float, ...]) -> Callable[[Tensor], Tensor]:
    """``x * std + mean`` per channel (the inverse of a scenario's normalisation)."""
    mean_t = torch.tensor(list(mean)).view(1, -1, 1, 1)
    std_t = torch.tensor(list(std)).view(1, -1, 1, 1)
    return lambda images: images * std_t + mean_t


class DLGLeNet(nn.Module):
    """The LeNet of DLG's experiments, which FedMD-CG's code uses for its privacy table.

    ``3 x [Conv5x5(12, pad 2, stride 2/2/1) + Sigmoid]`` then ``Flatten`` is the extractor
    (``12 * 8 * 8 = 768`` features for 32x32 inputs, 588 for 28x28, as the code's DLG LeNet);
    ``head`` is ``Linear(768, C)``. Smooth sigmoids and no pooling keep second-order gradients
    informative (DLG, Zhu et al. 2019); weights are drawn from ``U(-0.5, 0.5)`` as DLG does.

    Args:
        num_classes: number of logits.
        in_channels: image channels.
        input_size: side of the square inputs.
        seed: seed of the initialisation.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3, input_size: int = 32, seed: int = 0) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, 12, 5, padding=2, stride=2),
            nn.Sigmoid(),
            nn.Conv2d(12, 12, 5, padding=2, stride=2),
            nn.Sigmoid(),
            nn.Conv2d(12, 12, 5, padding=2, stride=1),
            nn.Sigmoid(),
            nn.Flatten(),
        )
        side = (input_size + 1) // 2
        side = (side + 1) // 2
        self.num_features = 12 * side * side
        self.head = nn.Linear(self.num_features, num_classes)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.rand(parameter.shape, generator=generator) - 0.5)

    def forward_features(self, x: Tensor) -> Tensor:
        return self.body(x)

    def forward_head(self, features: Tensor) -> Tensor:
        return self.head(features)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))
