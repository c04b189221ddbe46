"""FedDF's server form (``feddf_server``) against FedAvg and the lock-step FedDF, on both embedded scenarios.

Rows per scenario, every row with the scenario's one client optimizer, budget and data:

* ``fedavg``: FedAvg on the homogeneous family (``cpu_homo``);
* ``feddf_server_homo``: FedAvg's clients and averaging on ``cpu_homo``, then the server's
  ensemble distillation on public photo crops (the paper's FedDF with one architecture);
* ``feddf_server``: the same on the heterogeneous family (per-architecture averaging);
* ``feddf``: the lock-step, serverless FedDF of FCCL+'s benchmark on the heterogeneous family.

Label skew: ``configs/experiments/digits_dir/`` (10 clients, Dirichlet 0.1, SGD 0.05); Digits:
``configs/experiments/digits/`` (4 domains, Adam 1e-3, a new optimizer each round, FedDF's
settings). ``--rounds`` shortens both for CPU. Results (means over the last 3 evaluated rounds and
the server model's ``acc_server``) go to ``docs/results/feddf_server.{md,json}``.

    python benchmarks/feddf_server.py --seeds 0 --rounds 10 [--scenarios label_skew digits]
        [--distill_steps N] [--jobs 1] [--report_only]

Each scenario's rounds and distillation budget are remembered in ``<root>/settings.json`` so the
report states the command behind every table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from comparison import REPO, Run, cell, execute, last_mean, load, write_atomic

DIGITS_OPTIMIZER = (
    "--method.init_args.optimizer=adam",
    "--method.init_args.lr=0.001",
    "--method.init_args.momentum=0.0",
    "--method.init_args.weight_decay=0.00001",
    "--federation.persist_optimizer_state=false",
)
SCENARIOS = {
    "label_skew": {
        "folder": "configs/experiments/digits_dir",
        "keys": ("acc_local", "acc_global", "acc_server"),
        "fedavg_flags": (),
    },
    "digits": {
        "folder": "configs/experiments/digits",
        "keys": ("acc_intra", "acc_inter", "acc_server"),
        "fedavg_flags": DIGITS_OPTIMIZER,
    },
}


def runs_for(scenario: str, seeds: list[int], rounds: int, distill_steps: int | None = None) -> list[Run]:
    """The comparison's runs on one scenario (``distill_steps`` overrides the configs' server budget)."""
    spec = SCENARIOS[scenario]
    folder = spec["folder"]
    common = (f"--rounds={rounds}",)
    distill = () if distill_steps is None else (f"--method.init_args.distill_steps={distill_steps}",)
    rows = [
        ("fedavg", f"{folder}/fedavg.yaml", (*common, *spec["fedavg_flags"])),
        ("feddf_server_homo", f"{folder}/feddf_server.yaml", (*common, *distill, "--models=cpu_homo")),
        ("feddf_server", f"{folder}/feddf_server.yaml", (*common, *distill)),
        ("feddf", f"{folder}/feddf.yaml", common),
    ]
    return [Run(f"{scenario}/{label}", config, seed, flags) for label, config, flags in rows for seed in seeds]


def report(root: Path, seeds: list[int], rounds: int, settings: dict[str, dict]) -> dict:
    """Tables (Markdown and JSON) of every finished run."""
    results: dict = {}
    lines = [
        "# FedDF's server form against FedAvg and lock-step FedDF",
        "",
        f"Seeds: {' '.join(map(str, seeds))}. "
        "Values: mean over the last 3 evaluated rounds (seeds: mean ± std). `acc_server`: the server's "
        "global model(s) on the global test sets; `-`: the method has no server model.",
        "",
    ]
    for scenario, spec in SCENARIOS.items():
        if scenario not in settings:
            continue
        rounds, distill = settings[scenario]["rounds"], settings[scenario]["distill_steps"]
        command = f"python benchmarks/feddf_server.py --seeds {' '.join(map(str, seeds))} --scenarios {scenario} --rounds {rounds}"
        command += f" --distill_steps {distill}" if distill is not None else ""
        lines += [
            f"Command for {scenario}: `{command}`" + ("" if distill is not None else " (the configs' distill_steps)"),
            "",
        ]
        keys = spec["keys"]
        lines += [f"## {scenario}", "", "| method | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        runs = runs_for(scenario, seeds, rounds, distill)
        for run_label in dict.fromkeys(r.label for r in runs):
            done = [r for r in runs if r.label == run_label and (r.run_dir(root) / "summary.json").exists()]
            if not done:
                continue
            values = {k: [last_mean(load(r, root)["history"], k) for r in done] for k in keys}
            results[run_label] = {k: v for k, v in values.items()}
            cells = [cell(v) if all(x == x for x in v) else "-" for v in values.values()]
            lines.append(f"| {run_label.split('/', 1)[1]} | " + " | ".join(cells) + " |")
        lines.append("")
    write_atomic(REPO / "docs/results/feddf_server.md", "\n".join(lines))
    write_atomic(REPO / "docs/results/feddf_server.json", json.dumps(results, indent=2))
    return results


def main() -> None:
    """Run (resumably) and report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    parser.add_argument(
        "--distill_steps", type=int, default=None, help="server steps per round (default: the configs')"
    )
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--root", type=Path, default=REPO / "runs/feddf_server")
    parser.add_argument("--report_only", action="store_true")
    args = parser.parse_args()
    if not args.report_only:
        runs = [
            r for scenario in args.scenarios for r in runs_for(scenario, args.seeds, args.rounds, args.distill_steps)
        ]
        execute(runs, args.root, args.jobs)
    settings_path = args.root / "settings.json"
    settings = json.loads(settings_path.read_text()) if settings_path.exists() else {}
    settings.update({s: {"rounds": args.rounds, "distill_steps": args.distill_steps} for s in args.scenarios})
    write_atomic(settings_path, json.dumps(settings, indent=2))
    print(json.dumps(report(args.root, args.seeds, args.rounds, settings), indent=2))


if __name__ == "__main__":
    main()
