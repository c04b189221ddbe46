"""Largest relative update and value of honest uploads in shipped configs: evidence for the default bounds.

For each config and seed, runs ``fedhet fit`` for a few rounds with both upload bounds off and
reads the per-round ``comm/max_update_ratio`` (``||w_k - w|| / ||w||`` of the weights each
client sent against the global model it received) and ``comm/max_upload_value`` (largest
magnitude uploaded) from the round records. The defaults (``federation.upload_norm_bound`` 10,
``upload_value_bound`` 1e6) must sit far above every honest number; results are merged into
``docs/results/upload_bounds.json`` and printed as a markdown table.

Run: ``WANDB_MODE=disabled python benchmarks/upload_bounds.py [--rounds 3] [--seeds 0 1]
[--configs configs/experiments/digits_dir/fedavg.yaml ...] [--out FILE]``
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from fedhet.cli import fit

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "results" / "upload_bounds.json"
DEFAULT_CONFIGS = ["configs/experiments/digits_dir/fedavg.yaml", "configs/experiments/mnist_ftg/fedavg.yaml"]


class Records:
    """Round observer keeping every round record."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def on_round_end(self, loop: Any, record: dict[str, Any]) -> None:
        self.records.append(dict(record))

    def on_run_end(self, loop: Any, summary: dict[str, Any]) -> None:
        pass


def measure(config: str, seed: int, rounds: int) -> dict[str, Any]:
    """One run of ``config`` without bounds; the largest ratio and value over its rounds."""
    records = Records()
    with tempfile.TemporaryDirectory() as tmp:
        fit(
            [
                "--config", config, "--seed", str(seed), "--rounds", str(rounds),
                "--run_dir", str(Path(tmp) / "run"),
                "--federation.upload_norm_bound", "null", "--federation.upload_value_bound", "null",
                "--federation.eval_every", str(rounds), "--federation.eval_clients", "1",
            ],
            callbacks=[records],
        )
    ratios = [r["comm/max_update_ratio"] for r in records.records if "comm/max_update_ratio" in r]
    values = [r["comm/max_upload_value"] for r in records.records if "comm/max_upload_value" in r]
    return {
        "config": config,
        "seed": seed,
        "rounds": rounds,
        "max_update_ratio": max(ratios, default=None),
        "ratio_per_round": ratios,
        "max_upload_value": max(values, default=None),
    }


def table(results: list[dict[str, Any]]) -> str:
    """A markdown table of every measured run."""
    lines = [
        "| config | seed | rounds | max update ratio (bound 10) | per round | max value (bound 1e6) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in sorted(results, key=lambda r: (r["config"], r["seed"])):
        ratio = "n/a" if r["max_update_ratio"] is None else f"{r['max_update_ratio']:.3f}"
        per_round = ", ".join(f"{x:.2f}" for x in r["ratio_per_round"])
        value = f"{r['max_upload_value']:.3g}"
        lines.append(f"| `{r['config']}` | {r['seed']} | {r['rounds']} | {ratio} | {per_round} | {value} |")
    return "\n".join(lines)


def main() -> None:
    """Measure the asked configs and seeds, merge into the JSON, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=OUT, help="the JSON the results merge into")
    args = parser.parse_args()
    logging.getLogger("fedhet").setLevel(logging.WARNING)
    results = json.loads(args.out.read_text()) if args.out.exists() else []
    for config in args.configs:
        for seed in args.seeds:
            results = [r for r in results if (r["config"], r["seed"]) != (config, seed)]
            results.append(measure(config, seed, args.rounds))
            args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
