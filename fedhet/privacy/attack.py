"""FedMD-CG's Table 2 as cells: the gradient-inversion attack on one method's upload, per seed.

One cell is one *target* at one seed: a method whose upload is attacked (:data:`ATTACKED`), or a
gradient-free reference row (:data:`REFERENCES`), scored on the same training digits. ``fedhet
attack`` (:mod:`fedhet.privacy.command`) runs a cell into a run directory, so that a grid page
(``configs/grids/fedmdcg_privacy.yaml``) pairs the rows seed by seed like every other page.

What a seed fixes, for every target alike (so two rows at one seed attack the same digit through
the same networks): the attacked digits (the first ``images`` of a permutation of the 4,000
``mnist_all`` training digits drawn with the seed), the victim's DLG LeNet (initialised with
``100 + seed``), the attacker's own copy for *uploads only* (``200 + seed``), the conditional
generator of the generator methods (``500 + seed``), FedCG's latent discriminator (``300 + seed``)
and the attacker's own one (``400 + seed``). The generator noise and the attack's dummy image are
seeded by the digit's index. Every draw uses its own seed, so a cell's numbers do not depend on
what else ran in the process (the former script built the generator from the process's global
random state, so a seed's numbers depended on the seeds run before it).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from fedhet.algorithms.fedcg import LatentDiscriminator
from fedhet.algorithms.fedmdcg import ConditionalFeatureGenerator
from fedhet.data.embedded import load_mnist_all
from fedhet.privacy.gradient_inversion import UPLOADED_PARTS, DLGLeNet, denormalizer, invert_gradients, reference_psnrs

#: The methods whose upload is attacked (keys of :data:`fedhet.privacy.UPLOADED_PARTS`), in Table 2's order.
ATTACKED: tuple[str, ...] = ("fedavg", "fedper", "lg_fedavg", "fedcg", "fedmdcg")
#: The gradient-free reference rows (keys of :func:`fedhet.privacy.reference_psnrs`) and what each one is.
REFERENCES: dict[str, str] = {
    "all_black": "an all-black image",
    "dataset_mean": "the training digits' per-pixel mean image",
    "untouched_dummy": "the attack's random starting image, untouched",
}
#: Every target a cell may have.
TARGETS: tuple[str, ...] = (*ATTACKED, *REFERENCES)
#: The two attacker knowledges: the victim's whole model (DLG's assumption), or its uploads only.
KNOWLEDGES: tuple[str, ...] = ("whole_model", "uploads_only")

#: The generator methods' noise dimension and the dataset's normalisation (mean, std per channel).
NOISE_DIM = 128
NORMALIZATION = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))


@dataclass(frozen=True)
class AttackSettings:
    """The settings of one attack cell (``fedhet attack`` flags or its ``--config`` keys).

    Args:
        target: a key of :data:`TARGETS`.
        steps: Adam steps of the attack on each digit.
        images: digits attacked per seed (one attack each).
        lr: Adam learning rate on the dummy image.
        tv_weight: weight of the total-variation prior.
    """

    target: str
    steps: int = 500
    images: int = 1
    lr: float = 0.1
    tv_weight: float = 1e-2

    def check(self) -> None:
        """Raise ``ValueError`` naming the first bad setting."""
        if self.target not in TARGETS:
            raise ValueError(f"target {self.target!r}: use one of {', '.join(TARGETS)}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 0:
            raise ValueError(f"steps {self.steps!r}: write a whole number of attack steps, 0 or more")
        if isinstance(self.images, bool) or not isinstance(self.images, int) or self.images < 1:
            raise ValueError(f"images {self.images!r}: attack at least one digit per seed")
        for name in ("lr", "tv_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} {value!r}: write a number, 0 or more")
        if self.lr == 0 and self.steps > 0:
            raise ValueError("lr 0: the attack would not move its dummy image; give a positive lr")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def attack_cell(settings: AttackSettings, seed: int) -> list[dict[str, Any]]:
    """The attack of ``settings.target`` at ``seed``: one entry per attacked digit.

    Each entry holds the digit's ``index`` among the training digits, its ``label``, and
    ``psnr_<knowledge>`` (dB) per attacker knowledge, with the final matching loss
    ``matching_loss_<knowledge>`` of an attacked method. A reference row uses no gradient, so its
    PSNR is the same under both knowledges.
    """
    settings.check()
    splits = load_mnist_all(0)
    restore = denormalizer(*NORMALIZATION)
    order = torch.randperm(len(splits.train), generator=torch.Generator().manual_seed(seed))[: settings.images]
    entries = []
    if settings.target in REFERENCES:
        dataset_mean = (splits.train.x.float() / 255.0).mean(0)
        for index in order.tolist():
            x, y = _digit(splits, index)
            value = round(reference_psnrs(x, restore, dataset_mean, seed=index)[settings.target], 3)
            entries.append({"index": index, "label": int(y), **{f"psnr_{k}": value for k in KNOWLEDGES}})
        return entries
    victim = DLGLeNet(seed=100 + seed)
    guess = DLGLeNet(seed=200 + seed)
    with torch.random.fork_rng():  # the process's random state is neither used nor changed
        torch.manual_seed(500 + seed)
        generator = ConditionalFeatureGenerator(NOISE_DIM, 10, victim.num_features).eval()
        torch.manual_seed(300 + seed)
        discriminator = LatentDiscriminator(victim.head, 10, conditional=True).eval()  # FedCG's, never uploaded
        torch.manual_seed(400 + seed)
        guess_discriminator = LatentDiscriminator(victim.head, 10, conditional=True).eval()
    fedcg = settings.target == "fedcg"
    parts, with_generator = UPLOADED_PARTS[settings.target]
    everything_uploaded = set(parts) == {"extractor", "head"} and not with_generator  # FedAvg
    for index in order.tolist():
        x, y = _digit(splits, index)
        noise = torch.randn(1, NOISE_DIM, generator=torch.Generator().manual_seed(index))
        entry: dict[str, Any] = {"index": index, "label": int(y)}
        for knowledge, attacker_guess in zip(KNOWLEDGES, (None, guess), strict=True):
            if attacker_guess is not None and everything_uploaded:  # the attacker holds the whole model anyway
                entry[f"psnr_{knowledge}"] = entry["psnr_whole_model"]
                if "matching_loss_whole_model" in entry:
                    entry[f"matching_loss_{knowledge}"] = entry["matching_loss_whole_model"]
                continue
            result = invert_gradients(
                victim, x, y, settings.target, restore, attacker_guess,
                generator if with_generator else None, noise if with_generator else None,
                steps=settings.steps, lr=settings.lr, tv_weight=settings.tv_weight, seed=index,
                discriminator=discriminator if fedcg else None,
                guess_discriminator=guess_discriminator if fedcg else None,
            )  # fmt: skip
            entry[f"psnr_{knowledge}"] = round(result.psnr, 3)
            if math.isfinite(result.matching_loss):  # none after 0 steps
                entry[f"matching_loss_{knowledge}"] = round(result.matching_loss, 6)
        entries.append(entry)
    return entries


def _digit(splits: Any, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One training digit, normalised as the client sees it, and its label."""
    x = (splits.train.x[index : index + 1].float() / 255.0 - 0.5) / 0.5
    return x, splits.train.y[index : index + 1].long()


__all__ = ["ATTACKED", "KNOWLEDGES", "REFERENCES", "TARGETS", "AttackSettings", "attack_cell"]
