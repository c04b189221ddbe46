"""FedKTL's class-wise prototypical images across rounds (the paper's Fig. 5), for rows of a grid page.

The paper claims the images FedKTL's server generates for the classes look alike in early rounds,
become class-discriminative, and then settle, and that without the ETF classifier or without
L^MSE they are less class-discriminative (Sec. 5.4). This probe reruns rows of a grid file (by
default the tuned FedKTL page's practical FedKTL row and those two ablation arms) at one seed,
keeps the class images every round's download carries, and measures:

* **class separation**: the mean RMS pixel distance between the images of two classes, as a share
  of the generator's spread (the same distance between images of random latents): 0 when every
  class gets the same image, about 1 when the classes differ as much as random images do;
* **change**: each class image's RMS change since the previous round, in the same unit;
* **recognised**: the share of the class images the clients classify as their class.

No hyperparameter lives here: each run is the row's config and flags from the grid (a tuned row's
selected config once the grid's tuning stage has written it), the seed and the callback that keeps
the images. Writes ``docs/results/fedktl_images.{md,json,png}``.

    python reproductions/fedktl_images.py --grid configs/grids/fedktl_tuned.yaml --seed 0
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from comparison import REPO, write_atomic

from fedhet.pages import parse_grid

OUT = REPO / "docs" / "results"
DEFAULT_ROWS = ["practical/fedktl", "practical/fedktl_wo_etf", "practical/fedktl_wo_lmse"]


def mean_pairwise_rms(images: torch.Tensor) -> float:
    """Mean RMS pixel distance over all pairs of different images."""
    flat = images.flatten(1).double()
    count = flat.shape[0]
    distances = torch.cdist(flat, flat) / flat.shape[1] ** 0.5
    return float(distances.sum() / (count * (count - 1)))


def generator_spread(name: str, samples: int = 64, seed: int = 0) -> float:
    """The unit of class separation: mean pairwise distance of images from random latents of ``name``."""
    from fedhet.generators import load_generator

    generator = load_generator(name)
    with torch.no_grad():
        w = generator.sample_w(samples, torch.Generator().manual_seed(seed))
        return mean_pairwise_rms(generator.synthesize(w))


class KeepImages:
    """Round observer: the class images of the round's download, and the share the clients recognise."""

    def __init__(self) -> None:
        self.rounds: list[tuple[int, torch.Tensor, float]] = []
        self.generator: str | None = None

    def on_round_end(self, loop: Any, record: dict[str, Any]) -> None:
        self.generator = loop.algorithm.hp.generator
        download = loop.server.download_for(0)
        images = next(t for _, t in download.tensors() if t.dim() == 4).detach().cpu()
        labels = torch.arange(images.shape[0])
        hits = 0
        for cid in range(loop.scenario.num_clients):
            module = loop.runtime.module(loop.architectures[cid])
            module.load_client_state(loop.store.get(cid)["module"])
            module.on_receive(download)
            module.eval()
            with torch.no_grad():
                hits += int((module(images).argmax(1) == labels).sum())
            module.train()
        self.rounds.append((record["round"], images, 100.0 * hits / (len(labels) * loop.scenario.num_clients)))

    def on_run_end(self, loop: Any, summary: dict[str, Any]) -> None:
        pass


def row_recipe(grid_path: str, label: str) -> tuple[str, tuple[str, ...], str]:
    """A grid row's config and flags (its selected config when the grid tuned it), and its name."""
    grid = parse_grid(grid_path)
    row = next((r for r in grid.rows if r.label == label), None)
    if row is None:
        raise SystemExit(f"{grid_path}: no row labelled {label!r}; rows: {', '.join(r.label for r in grid.rows)}")
    if grid.tuned(row):
        selected = grid.selected_config(row)
        if not selected.is_file():
            raise SystemExit(f"{label}: {selected} is not written yet; run `{grid.command()}` first")
        return str(selected), (), row.name
    return row.config, row.flags, row.name


def image_run(config: str, flags: tuple[str, ...], seed: int, run_dir: Path) -> tuple[list, str | None]:
    """One run keeping every round's class images; returns them and the run's generator name."""
    from fedhet.cli import fit

    keep = KeepImages()
    if run_dir.exists():
        shutil.rmtree(run_dir)
    fit(["--config", config, "--seed", str(seed), "--run_dir", str(run_dir), *flags], callbacks=[keep])
    return keep.rounds, keep.generator


def series(grabbed: list[tuple[int, torch.Tensor, float]], spread: float) -> dict[str, list]:
    """Per round: class separation, change since the previous round, and the recognised share."""
    previous = [None] + [g[1] for g in grabbed[:-1]]
    return {
        "rounds": [g[0] + 1 for g in grabbed],
        "class_separation": [round(mean_pairwise_rms(g[1]) / spread, 4) for g in grabbed],
        "change_since_previous_round": [
            None if before is None
            else round(float((g[1] - before).double().pow(2).mean(dim=(1, 2, 3)).sqrt().mean()) / spread, 4)
            for g, before in zip(grabbed, previous, strict=True)
        ],
        "client_accuracy_on_images": [round(g[2], 2) for g in grabbed],
    }


def rounds_to_show(count_of_rounds: int, count: int = 6) -> list[int]:
    """Indices of about ``count`` evenly spread rounds, first and last included."""
    if count_of_rounds <= count:
        return list(range(count_of_rounds))
    step = (count_of_rounds - 1) / (count - 1)
    return sorted({round(i * step) for i in range(count)})


def image_grid_png(path: Path, grabbed: list[tuple[int, torch.Tensor, float]], separation: list[float]) -> None:
    """The first row's class images at a few rounds, one line per round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = rounds_to_show(len(grabbed))
    classes = grabbed[0][1].shape[0]
    fig, axes = plt.subplots(len(shown), classes, figsize=(classes * 0.9, len(shown) * 0.95 + 0.3), squeeze=False)
    for line, index in enumerate(shown):
        round_idx, images, _ = grabbed[index]
        for c in range(classes):
            image = images[c].float()
            image = (image - image.min()) / (image.max() - image.min() + 1e-8)
            ax = axes[line][c]
            ax.imshow(image.permute(1, 2, 0).squeeze().numpy(), cmap="gray" if image.shape[0] == 1 else None)
            ax.set_xticks([])
            ax.set_yticks([])
            if line == 0:
                ax.set_title(str(c), fontsize=8)
        axes[line][0].set_ylabel(f"r{round_idx + 1}\nsep {separation[index]:.2f}", fontsize=7, rotation=0, labelpad=20)
    fig.suptitle("FedKTL class-wise prototypical images by round (left: round, class separation)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def observations(result: dict[str, Any], first: str) -> list[str]:
    """The paper's image claims, read on this one seed (observations, not verdicts: one seed has no interval)."""
    ours = result["rows"][first]
    separation, change = ours["class_separation"], ours["change_since_previous_round"]
    lines = [f"* Separation at the first round {separation[0]:.3f}, at the last {separation[-1]:.3f} "
             f"({'higher' if separation[-1] > separation[0] else 'not higher'} at the end)."]
    if len(change) > 2:
        lines.append(f"* Change per round at round 2 {change[1]:.3f}, at the last round {change[-1]:.3f} "
                     f"({'smaller' if change[-1] < change[1] else 'not smaller'} at the end).")
    for label, other in result["rows"].items():
        if label != first:
            last = other["class_separation"][-1]
            lines.append(f"* {other['name']}: last-round separation {last:.3f} against {separation[-1]:.3f} "
                         f"({'lower' if last < separation[-1] else 'not lower'}).")
    recognised = [v for row in result["rows"].values() for v in row["client_accuracy_on_images"]]
    lines.append(f"* The clients classify {min(recognised):.0f}-{max(recognised):.0f} % of the class images as their "
                 f"class (chance: {100 / len(result['classes']):.0f} %).")
    return lines


def page(result: dict[str, Any], command: str, first: str) -> str:
    """The Markdown page: the drawn row's images, every row's series at a few rounds, the observations."""
    lines = [
        "# FedKTL's class-wise prototypical images across rounds (Fig. 5 analogue)",
        "",
        f"Generated by `{command}` (the rows' configs and flags come from the grid file; do not edit by hand). "
        f"Seed {result['seed']}; generator `{result['generator']}`, spread {result['generator_spread_rms']:.3f} "
        "(the mean RMS distance between images of random latents, the unit of separation and change).",
        "",
        f"![class-wise images](fedktl_images.png) (the images of {result['rows'][first]['name']})",
        "",
        "Class separation: the mean RMS pixel distance between the images of two classes, as a share of the "
        "generator's spread; 0 means every class gets the same image. Change: each class image's RMS change since "
        "the previous round, same unit. Recognised: share of the class images the clients classify as their class.",
        "",
        "| row | round | class separation | change | recognised |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in result["rows"].values():
        for i in rounds_to_show(len(row["rounds"])):
            change = row["change_since_previous_round"][i]
            lines.append(f"| {row['name']} | {row['rounds'][i]} | {row['class_separation'][i]:.3f} | "
                         f"{'-' if change is None else f'{change:.3f}'} | {row['client_accuracy_on_images'][i]:.0f}% |")
    lines += ["", "## The paper's image claims on this seed", "", *observations(result, first), "",
              "The paper does not claim the clients would recognise the images as digits: it \"prioritizes the "
              "class-wise discrimination of the generated images over their semantic content\"."]
    return "\n".join(lines) + "\n"


def main() -> None:
    """Run each row once at the seed, keep its images, write the page."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", default="configs/grids/fedktl_tuned.yaml")
    parser.add_argument("--rows", nargs="+", default=DEFAULT_ROWS, help="row labels; the first is drawn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", type=Path, default=REPO / "runs" / "fedktl_images")
    parser.add_argument("--out", type=Path, default=OUT, help="where the page, json and figure go")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result: dict[str, Any] = {"grid": args.grid, "seed": args.seed, "rows": {}}
    grabbed_first = None
    for label in args.rows:
        config, flags, name = row_recipe(args.grid, label)
        grabbed, generator = image_run(config, flags, args.seed, args.root / label.replace("/", "_"))
        if "generator" not in result:
            result["generator"] = generator
            result["generator_spread_rms"] = round(generator_spread(result["generator"]), 4)
            result["classes"] = list(range(grabbed[0][1].shape[0]))
            grabbed_first = grabbed
        result["rows"][label] = {"name": name, "config": config, "flags": list(flags),
                                 **series(grabbed, result["generator_spread_rms"])}
    command = (f"python reproductions/fedktl_images.py --grid {args.grid} --rows {' '.join(args.rows)} "
               f"--seed {args.seed}")
    result["command"] = command
    image_grid_png(args.out / "fedktl_images.png", grabbed_first, result["rows"][args.rows[0]]["class_separation"])
    write_atomic(args.out / "fedktl_images.json", json.dumps(result, indent=1) + "\n")
    text = page(result, command, args.rows[0])
    write_atomic(args.out / "fedktl_images.md", text)
    print(text)


if __name__ == "__main__":
    main()
