"""Run every shipped core experiment config once and tabulate the results.

For each method (local, fedavg, fedprox, fedproto, fd) and each embedded scenario (``digits``:
domain shift, one client per domain; ``digits_dir``: MNIST, Dirichlet 0.1, 10 clients), runs
``fedhet fit --config configs/experiments/<scenario>/<method>.yaml --run_dir <root>/<scenario>-<method>``
(skipping runs already complete under ``--root``) and prints a markdown table of the summaries.

Run: ``WANDB_MODE=disabled python benchmarks/core_configs.py [--root runs/core] [--seed 0]``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fedhet.cli import main as fedhet_main

METHODS = ["local", "fedavg", "fedprox", "fedproto", "fd"]
ROOT = Path(__file__).resolve().parents[1]


def run_all(root: Path, seed: int) -> dict[tuple[str, str], dict]:
    summaries = {}
    for scenario in ("digits", "digits_dir"):
        for method in METHODS:
            run_dir = root / f"{scenario}-{method}"
            if not (run_dir / "summary.json").exists():
                config = ROOT / "configs" / "experiments" / scenario / f"{method}.yaml"
                code = fedhet_main(["fit", "--config", str(config), "--seed", str(seed), "--run_dir", str(run_dir)])
                if code != 0:
                    raise SystemExit(f"{scenario}/{method} failed with exit code {code}")
            summaries[scenario, method] = json.loads((run_dir / "summary.json").read_text())
    return summaries


def _shared_cells(summary: dict) -> tuple[str, str, str]:
    """Method name, model family kind, and communication per round of one run."""
    comm = (summary["comm"]["bytes_up"] + summary["comm"]["bytes_down"]) / summary["rounds"] / 1e3
    models = "homogeneous" if len(set(summary["models"])) == 1 else "heterogeneous"
    return summary["method"], models, f"{comm:.1f} kB"


def table(summaries: dict[tuple[str, str], dict]) -> str:
    lines = [
        "### Domain shift: `configs/experiments/digits/` (4 clients, one per domain)",
        "",
        "| method | models | intra | inter | MNIST | UCI | MNIST-M | SYN | up+down per round | wall |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for method in METHODS:
        s = summaries["digits", method]
        final = s["final"]
        domains = "".join(f" {final[f'domain/{d}/acc_intra']:.1f} / {final[f'domain/{d}/acc_inter']:.1f} |"
                          for d in ("mnist", "uci", "mnistm", "syn"))
        name, models, comm = _shared_cells(s)
        lines.append(f"| {name} | {models} | {final['acc_intra']:.2f} | {final['acc_inter']:.2f} |{domains}"
                     f" {comm} | {s['wall_s']:.0f} s |")
    lines += [
        "",
        "Per-domain cells are intra / inter of that domain's client (final round).",
        "",
        "### Label skew: `configs/experiments/digits_dir/` (MNIST, Dirichlet 0.1, 10 clients)",
        "",
        "| method | models | local (pooled) | local mean ± std | global | up+down per round | wall |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for method in METHODS:
        s = summaries["digits_dir", method]
        final = s["final"]
        name, models, comm = _shared_cells(s)
        lines.append(f"| {name} | {models} | {final['acc_local']:.2f} | {final['acc_local_mean']:.2f} ± "
                     f"{final['acc_local_std']:.2f} | {final['acc_global']:.2f} | {comm} | {s['wall_s']:.0f} s |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("runs/core"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(table(run_all(args.root, args.seed)))


if __name__ == "__main__":
    main()
