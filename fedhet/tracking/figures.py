"""End-of-run figures: ``curves.png``, ``matrix.png`` and, for a server that makes images, ``images_<name>.png``.

``curves.png`` shows the headline metrics per round, ``matrix.png`` the client x test set accuracy,
``images_<name>.png`` a server's images by round (FedKTL's class images).

Both are written into the run directory atomically (a temporary file renamed over the target)
and logged to W&B as images by :class:`~fedhet.tracking.WandbCallback`. They are drawn from
what the run already records (the loop's per-round history and ``summary["matrix"]``), so a
figure can never disagree with ``metrics.jsonl`` or ``summary.json``. A matrix of more than
:data:`~fedhet.tracking.console.MATRIX_ROWS` clients is drawn summarised, exactly as the console
prints it (quantiles per column, then the worst and best clients), with the client count in the
title: a heatmap of 800 one-pixel rows shows nothing.

A server's images (:meth:`~fedhet.algorithms.base.ServerPhase.images`) are kept every round in
``images/<name>.pt`` (each image scaled to its own 0-255 range, uint8, keyed by step), so a resumed
run's figure still shows the rounds before the interruption.

A figure that cannot be drawn (a broken matplotlib installation, say) costs a warning line, never
the run: the results files are the contract, figures are a convenience.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from fedhet.files import atomic_savefig, atomic_write
from fedhet.tracking.console import summarise_matrix

log = logging.getLogger("fedhet")

#: The figure files of a run directory, in the order they are logged.
FIGURES = ("curves.png", "matrix.png")
#: Where a run keeps its server's images, one ``<name>.pt`` per image batch name.
IMAGES_DIR = "images"
#: Rounds an image figure shows (evenly spread, first and last included).
IMAGE_ROUNDS = 6
#: Top-1 headline metrics drawn per scenario kind (the first two of ``fedhet.metrics.report.HEADLINE``).
CURVE_KEYS = {"domain_shift": ("acc_intra", "acc_inter"), "label_skew": ("acc_local", "acc_global")}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display: figures are files
    import matplotlib.pyplot as plt

    return plt


def curves_figure(history: Sequence[dict[str, Any]], kind: str, path: Path, title: str = "") -> None:
    """Headline accuracy per evaluated round (test solid, validation dashed) and the training loss.

    Args:
        history: the per-round records (``loop.history`` or the lines of ``metrics.jsonl``).
        kind: the scenario kind (``domain_shift`` or ``label_skew``).
        path: the PNG to write.
        title: figure title (method, scenario, seed).
    """
    plt = _pyplot()
    keys = CURVE_KEYS.get(kind, ())
    fig, (acc_ax, loss_ax) = plt.subplots(1, 2, figsize=(10, 3.8))
    for index, key in enumerate(keys):
        color = f"C{index}"
        rows = [r for r in history if key in r]
        x = [r["round"] + 1 for r in rows]
        marker = "o" if len(rows) < 30 else None
        acc_ax.plot(x, [r[key] for r in rows], color=color, marker=marker, markersize=3, label=f"{key} (test)")
        val = [r for r in rows if f"val/{key}" in r]
        if val:
            acc_ax.plot([r["round"] + 1 for r in val], [r[f"val/{key}"] for r in val], color=color, linestyle="--",
                        linewidth=1, label=f"{key} (val)")
    acc_ax.set_xlabel("round")
    acc_ax.set_ylabel("accuracy (%)")
    acc_ax.set_title("headline accuracy")
    acc_ax.grid(alpha=0.3)
    if keys:
        acc_ax.legend(fontsize=8)
    losses = [r for r in history if "train/loss" in r]
    loss_ax.plot([r["round"] + 1 for r in losses], [r["train/loss"] for r in losses], color="C3",
                 marker="o" if len(losses) < 30 else None, markersize=3)
    loss_ax.set_xlabel("round")
    loss_ax.set_ylabel("mean client training loss")
    loss_ax.set_title("training loss")
    loss_ax.grid(alpha=0.3)
    from matplotlib.ticker import MaxNLocator

    for ax in (acc_ax, loss_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    atomic_savefig(fig, path)
    plt.close(fig)


def matrix_figure(matrix: dict[str, Any], path: Path, title: str = "") -> None:
    """Heatmap of the final client x test-set top-1 accuracy (summarised above a few dozen clients).

    Args:
        matrix: ``summary["matrix"]`` (``rows``, ``columns``, ``top1`` in percent).
        path: the PNG to write.
        title: figure title (method, scenario, seed).
    """
    plt = _pyplot()
    rows, values, note = summarise_matrix(matrix)
    columns = list(matrix["columns"])
    clients = len(matrix["rows"])
    height = 1.6 + 0.32 * len(rows)
    width = 3.2 + max(len(r) for r in rows) * 0.06 + 0.9 * len(columns)
    fig, ax = plt.subplots(figsize=(width, height))
    image = ax.imshow(values, cmap="viridis", vmin=0.0, vmax=100.0, aspect="auto")
    ax.set_xticks(range(len(columns)))
    ax.set_xticklabels(columns, rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(rows, fontsize=8)
    for i, row in enumerate(values):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:.1f}", ha="center", va="center", fontsize=7,
                    color="white" if value < 55 else "black")
    if note:
        ax.axhline(5.5, color="white", linewidth=2)  # statistics above, named clients below
    heading = f"{clients} clients" + (" (summarised: statistics, then worst and best clients)" if note else "")
    ax.set_title(f"{title}\nfinal top-1 accuracy (%), {heading}" if title else f"final top-1 accuracy (%), {heading}",
                 fontsize=9)
    ax.set_xlabel("test set")
    fig.colorbar(image, ax=ax, fraction=0.04, pad=0.02)
    fig.tight_layout()
    atomic_savefig(fig, path)
    plt.close(fig)


def displayable(images: Tensor) -> Tensor:
    """Each image scaled to its own 0-255 range, as uint8 ``[n, c, h, w]`` (generated images have no fixed range)."""
    flat = images.detach().float().cpu().flatten(1)
    low, high = flat.min(1, keepdim=True).values, flat.max(1, keepdim=True).values
    scaled = (flat - low) / (high - low).clamp_min(1e-8)
    return (scaled * 255).round().to(torch.uint8).view_as(images)


def load_round_images(path: Path) -> dict[int, Tensor]:
    """The images a run kept per step (``{}`` when it kept none)."""
    if not Path(path).is_file():
        return {}
    return dict(torch.load(path, map_location="cpu", weights_only=True))


def save_round_images(run_dir: Path, step: int, images: dict[str, Tensor],
                      cache: dict[str, dict[int, Tensor]] | None = None) -> None:  # fmt: skip
    """Add step ``step``'s images to ``images/<name>.pt`` (steps from ``step`` on, left by a killed run, go).

    ``cache`` (name -> steps) holds what the file holds, so a run reads each file once, not every round.
    """
    for name, batch in images.items():
        path = Path(run_dir) / IMAGES_DIR / f"{name}.pt"
        known = cache.get(name) if cache is not None and name in cache else load_round_images(path)
        kept = {s: b for s, b in known.items() if s < step}
        kept[step] = displayable(batch)
        if cache is not None:
            cache[name] = kept
        atomic_write(path, lambda handle, kept=kept: torch.save(kept, handle))


def evenly_spread(count: int, shown: int = IMAGE_ROUNDS) -> list[int]:
    """Indices of about ``shown`` evenly spread items of ``count``, first and last included.

    >>> evenly_spread(11, 6), evenly_spread(3, 6)
    ([0, 2, 4, 6, 8, 10], [0, 1, 2])
    """
    if count <= shown:
        return list(range(count))
    step = (count - 1) / (shown - 1)
    return sorted({round(i * step) for i in range(shown)})


def images_figure(steps: dict[int, Tensor], path: Path, title: str = "") -> None:
    """One line per shown step (a few, evenly spread), one column per image (``steps``: uint8 ``[n, c, h, w]``)."""
    plt = _pyplot()
    ordered = sorted(steps)
    shown = [ordered[i] for i in evenly_spread(len(ordered))]
    columns = max(int(steps[s].shape[0]) for s in shown)
    fig, axes = plt.subplots(len(shown), columns, figsize=(columns * 0.9, len(shown) * 0.95 + 0.4), squeeze=False)
    for line, step in enumerate(shown):
        for column in range(columns):
            ax = axes[line][column]
            ax.set_xticks([])
            ax.set_yticks([])
            if column < steps[step].shape[0]:
                image = steps[step][column].permute(1, 2, 0).squeeze(-1).numpy()
                ax.imshow(image, cmap="gray" if image.ndim == 2 else None, vmin=0, vmax=255)
            if line == 0:
                ax.set_title(str(column), fontsize=8)
        axes[line][0].set_ylabel(f"round {step + 1}", fontsize=7, rotation=0, labelpad=22)
    if title:
        fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    atomic_savefig(fig, path)
    plt.close(fig)


def write_run_figures(run_dir: Path, history: Sequence[dict[str, Any]], summary: dict[str, Any]) -> list[Path]:
    """Draw ``curves.png`` and ``matrix.png`` into ``run_dir``; returns the files written."""
    title = f"{summary.get('method', '')} on {summary.get('scenario', '')}, seed {summary.get('seed', '')}"
    written = []
    curves = Path(run_dir) / "curves.png"
    curves_figure(history, str(summary.get("scenario_kind", "")), curves, title)
    written.append(curves)
    if summary.get("matrix"):
        matrix = Path(run_dir) / "matrix.png"
        matrix_figure(summary["matrix"], matrix, title)
        written.append(matrix)
    for kept in sorted((Path(run_dir) / IMAGES_DIR).glob("*.pt")):
        figure = Path(run_dir) / f"images_{kept.stem}.png"
        images_figure(load_round_images(kept), figure, f"{title}: {kept.stem} by round (columns: image index)")
        written.append(figure)
    return written


def figure_paths(run_dir: Path) -> list[Path]:
    """The figure files present in a run directory."""
    fixed = [Path(run_dir) / name for name in FIGURES if (Path(run_dir) / name).is_file()]
    return fixed + sorted(Path(run_dir).glob("images_*.png"))


class FiguresCallback:
    """Writes the run's figures when it ends (before the summary, so a complete run has them).

    Args:
        run_dir: the run directory.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.kept_images: dict[str, dict[int, Tensor]] = {}  # what images/<name>.pt holds, read once per run

    def on_round_end(self, loop: Any, record: dict[str, Any]) -> None:
        """Figures are drawn once, at the end; the server's images of the round are kept for them now."""
        try:
            images = loop.server.images()
            if images:
                save_round_images(self.run_dir, int(record["round"]), images, self.kept_images)
        except Exception as exc:  # a figure is never worth a lost run
            log.warning("server images not kept (%s: %s)", type(exc).__name__, " ".join(str(exc).split())[:200])

    def on_run_end(self, loop: Any, summary: dict[str, Any]) -> None:
        try:
            write_run_figures(self.run_dir, loop.history, summary)
        except Exception as exc:  # a figure is never worth a lost run
            log.warning("figures not written (%s: %s)", type(exc).__name__, " ".join(str(exc).split())[:200])
