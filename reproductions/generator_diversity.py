"""How diverse are FedKTL's embedded generators' samples? Pixel and feature-space spread, coverage.

For each generator (default: ``untrained``, ``embedded-stylegan``, ``embedded-stylegan-pool``;
missing embedded ones are built on first use) it draws ``--samples`` images from fixed latents
and measures, next to the same numbers for real image sets:

* **pixel spread**: mean RMS distance between two different samples (images in ``[-1, 1]``,
  32x32x3), the unit of the FedKTL benchmark's class separation;
* **feature spread**: mean Euclidean distance between two samples' features in a *fixed,
  randomly initialised* CNN (seeded; three 3x3 conv + ReLU + 2x2 average-pool stages, 32/64/128
  channels, global average pooling). Random-initialisation embeddings are what Naeem et al.
  (ICML 2020, "Reliable Fidelity and Diversity Metrics for Generative Models") propose where no
  pretrained feature network fits the data; it needs no download and sees colour, texture and
  stroke structure rather than single pixels;
* **coverage** (Naeem et al. 2020, k = 5, in the same feature space): the share of real images
  whose k-nearest-neighbour ball (among the real images) holds at least one sample. A generator
  that collapses onto a few modes covers few real images, one that spreads over its data covers
  most. Measured against two real sets: the generator's own training distribution (read from
  its artifact's metadata; augmented if it was trained augmented), and a *common* reference, the
  unaugmented, source-balanced pool of every embedded source the MNIST clients do not hold
  (UCI, MNIST-M, font digits, photo crops), the same for every generator.

Ratios: each spread as a share of its own training data's spread (1 = as diverse as the data),
and every metric of the last generator relative to the second (pool vs photos by default).

Run: ``OMP_NUM_THREADS=1 python reproductions/generator_diversity.py [--out docs/results/generator_diversity.json]``
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

COMMON_SOURCES = ("uci", "mnistm", "syn", "photos")


def mean_pairwise(values: Tensor, rms: bool = False) -> float:
    """Mean distance over all pairs of different rows (RMS per coordinate when ``rms``)."""
    flat = values.flatten(1).double()
    distances = torch.cdist(flat, flat)
    if rms:
        distances = distances / flat.shape[1] ** 0.5
    count = flat.shape[0]
    return float(distances.sum() / (count * (count - 1)))


def feature_network(seed: int = 0) -> nn.Module:
    """The fixed random CNN of the feature space (same weights in every run)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        channels = 3
        for width in (32, 64, 128):
            conv = nn.Conv2d(channels, width, 3, padding=1)
            nn.init.kaiming_normal_(conv.weight, nonlinearity="relu")
            nn.init.zeros_(conv.bias)
            layers += [conv, nn.ReLU(), nn.AvgPool2d(2)]
            channels = width
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        return nn.Sequential(*layers).eval().requires_grad_(False)


def coverage(real: Tensor, fake: Tensor, k: int = 5) -> float:
    """Naeem et al. (2020): share of real points with a fake point inside their k-NN ball."""
    real, fake = real.double(), fake.double()
    radii = torch.cdist(real, real).kthvalue(k + 1, dim=1).values  # k+1: the point itself is at 0
    nearest_fake = torch.cdist(real, fake).min(dim=1).values
    return float((nearest_fake < radii).double().mean())


def real_images(sources: tuple[str, ...], augment: bool, count: int, seed: int, size: int = 32) -> Tensor:
    """``count`` images in ``[-1, 1]`` drawn source-balanced from the embedded training splits."""
    from fedhet.data import load_dataset
    from fedhet.generators.pretrain import _PoolBatches

    pools = [load_dataset(source, None, 0, size).train.x for source in sources]
    return next(iter(_PoolBatches(pools, 1, count, seed, augment)))


def training_distribution(name: str) -> tuple[tuple[str, ...], bool] | None:
    """The sources and augmentation an artifact was trained on (``None`` for ``untrained``)."""
    from fedhet.generators.base import generators_dir

    sidecar = generators_dir() / f"{name}.json"
    if not sidecar.is_file():
        return None
    training = json.loads(sidecar.read_text())["training"]
    return tuple(training["data"].split("+")), "augment" in training


def measure(names: list[str], samples: int, real_count: int, seed: int) -> dict[str, Any]:
    """Pixel and feature spread and coverage of each generator's samples against real images."""
    from fedhet.generators import load_generator

    torch.set_num_threads(1)
    network = feature_network()
    common = real_images(COMMON_SOURCES, False, real_count, seed + 1)
    with torch.no_grad():
        common_features = network(common)
    result: dict[str, Any] = {
        "samples": samples,
        "real": real_count,
        "common_reference": {"sources": list(COMMON_SOURCES), "pixel_spread": round(mean_pairwise(common, rms=True), 4),
                             "feature_spread": round(mean_pairwise(common_features), 4)},
        "generators": {},
    }
    for name in names:
        generator = load_generator(name)
        with torch.no_grad():
            w = generator.sample_w(samples, torch.Generator().manual_seed(seed))
            images = torch.cat([generator.synthesize(chunk) for chunk in w.split(128)]).clamp(-1, 1)
            if images.shape[-1] != 32:
                images = nn.functional.interpolate(images, size=(32, 32), mode="bilinear", antialias=True)
            features = network(images)
        row: dict[str, Any] = {
            "pixel_spread": round(mean_pairwise(images, rms=True), 4),
            "feature_spread": round(mean_pairwise(features), 4),
            "coverage_common": round(coverage(common_features, features), 4),
        }
        trained_on = training_distribution(name) if name != "untrained" else None
        if trained_on is not None:
            own = real_images(trained_on[0], trained_on[1], real_count, seed + 2)
            with torch.no_grad():
                own_features = network(own)
            own_pixel, own_feature = mean_pairwise(own, rms=True), mean_pairwise(own_features)
            row.update({
                "trained_on": "+".join(trained_on[0]) + (" (augmented)" if trained_on[1] else ""),
                "data_pixel_spread": round(own_pixel, 4),
                "data_feature_spread": round(own_feature, 4),
                "pixel_spread_vs_data": round(row["pixel_spread"] / own_pixel, 3),
                "feature_spread_vs_data": round(row["feature_spread"] / own_feature, 3),
                "coverage_own_data": round(coverage(own_features, features), 4),
            })
        result["generators"][name] = row
    return result


def markdown(result: dict[str, Any]) -> str:
    """The measurements as a Markdown table, one row per generator and one for the real common pool."""
    lines = [
        "| generator | trained on | pixel spread (x its data) | feature spread (x its data) | coverage of own data "
        "| coverage of common pool |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in result["generators"].items():
        own = "coverage_own_data" in row
        pixel = f"{row['pixel_spread']:.3f}" + (f" ({row['pixel_spread_vs_data']:.2f}x)" if own else "")
        feature = f"{row['feature_spread']:.3f}" + (f" ({row['feature_spread_vs_data']:.2f}x)" if own else "")
        lines.append(f"| `{name}` | {row.get('trained_on', '— (random weights)')} | {pixel} | {feature} | "
                     f"{row['coverage_own_data']:.2f} | " if own
                     else f"| `{name}` | — (random weights) | {pixel} | {feature} | — | ")
        lines[-1] += f"{row['coverage_common']:.2f} |"
    reference = result["common_reference"]
    lines.append(f"| *common pool, real images* | {'+'.join(reference['sources'])} | {reference['pixel_spread']:.3f} "
                 f"| {reference['feature_spread']:.3f} | | |")
    return "\n".join(lines)


def main() -> None:
    """Measure the generators named on the command line and print (and optionally save) the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generators", nargs="+", default=["untrained", "embedded-stylegan", "embedded-stylegan-pool"])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--real", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the numbers as JSON here")
    args = parser.parse_args()
    result = measure(args.generators, args.samples, args.real, args.seed)
    print(markdown(result))
    names = list(result["generators"])
    if len(names) >= 2:
        new, old = result["generators"][names[-1]], result["generators"][names[-2]]
        print(f"\nratios {names[-1]} / {names[-2]}:")
        for key in ("pixel_spread", "feature_spread", "coverage_common", "coverage_own_data"):
            if key in new and key in old and old[key]:
                print(f"  {key}: {new[key] / old[key]:.2f}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
