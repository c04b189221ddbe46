"""Stability of the shipped Digits configs: does every one complete at several seeds?

Runs every ``configs/experiments/{digits,digits_dir,digits_path}/*.yaml`` at ``--seeds`` (one
single-threaded ``fedhet fit`` process per run, ``--jobs`` at a time) and lists the runs that did
not complete: a *divergence* is a run stopped by the round loop's non-finite-loss check
("client k got a non-finite training loss in round r"), any other non-zero exit is a *failure*.
A budget flag shrinks the local work (``--max-epochs``, ``--rounds``) while keeping the rounds
where divergences were seen (FD diverged in round 19 of 20 on ``digits_dir`` at seed 11), so the
default keeps each config's own rounds. ``--eval-every`` evaluates only every N rounds (the last
always): the non-finite check is on training losses and uploads, so it sees every round anyway.

``--extra=--key=value`` (repeatable) runs a variant, recorded with its flags
(``--extra=--method.init_args.distillation=mse`` reruns FD's HtFLlib form). ``--only`` keeps the
configs whose ``folder/name`` contains one of the given strings (``--only fd`` runs the three FD
configs). Results accumulate across invocations in
``docs/results/stability.json`` (a later run of other configs adds rows, a rerun of the same
config, seed and budget replaces its row); the page ``docs/results/stability.md`` lists every
shipped config, run or not, so what was not run is visible.

Run: ``python reproductions/stability.py --seeds 0 1 2 3 4 --only fd`` (the runs live under
``runs/stability``; completed runs are skipped when the command is repeated).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import time
from pathlib import Path
from typing import Any

from comparison import REPO, Run, write_atomic

from fedhet.bench import child_environment, last_log_line, load_run, run_cells

FOLDERS = ("digits", "digits_dir", "digits_path")
RESULTS = REPO / "docs" / "results"
ROUND = re.compile(r"in round (\d+)")
HEADLINE = ("acc_intra", "acc_inter", "acc_local", "acc_global")
#: the seeds every shipped config must complete at (issue 15's acceptance)
ACCEPTANCE_SEEDS = (0, 1, 2, 3, 4)


def shipped_configs(folders: tuple[str, ...] = FOLDERS) -> list[str]:
    """Every shipped config of the folders, as ``folder/name`` (no extension), sorted."""
    return sorted(
        f"{folder}/{path.stem}"
        for folder in folders
        for path in (REPO / "configs" / "experiments" / folder).glob("*.yaml")
    )


def config_sha(config: str) -> str:
    """The first 10 hex digits of the SHA-256 of ``configs/experiments/<config>.yaml``: which version a row ran."""
    return hashlib.sha256((REPO / "configs" / "experiments" / f"{config}.yaml").read_bytes()).hexdigest()[:10]


def budget_flags(
    rounds: int | None, max_epochs: int | None, extra: tuple[str, ...] = (), eval_every: int | None = None
) -> tuple[str, ...]:
    """The ``fedhet fit`` flags of the budget (none: each config's own), then any extra flags."""
    flags: list[str] = []
    if rounds is not None:
        flags += ["--rounds", str(rounds)]
    if max_epochs is not None:
        flags += [f"--trainer.max_epochs={max_epochs}"]
    if eval_every is not None:
        flags += [f"--federation.eval_every={eval_every}"]
    return (*flags, *extra)


def budget_name(
    rounds: int | None, max_epochs: int | None, extra: tuple[str, ...] = (), eval_every: int | None = None
) -> str:
    """How the budget (and any extra flags) is written on the page."""
    name = f"rounds={rounds or 'config'}, max_epochs={max_epochs or 'config'}"
    if eval_every is not None:
        name += f", eval_every={eval_every}"
    return name + "".join(f", `{flag}`" for flag in extra)


def outcome(run: Run, root: Path) -> dict[str, Any]:
    """``ok`` with the final headline metrics, ``diverged`` with the round, or ``failed`` with the last log line."""
    run_dir = run.run_dir(root)
    if (run_dir / "summary.json").is_file():
        summary = load_run(run_dir)
        final = summary.get("final", {})
        keys = [k for k in HEADLINE if k in final]
        return {"status": "ok", "rounds": summary.get("rounds"), "final": {k: final[k] for k in keys}}
    line = last_log_line(run.log_path(root))
    if "non-finite" in line:  # a non-finite loss, or a non-finite upload caught where it enters
        match = ROUND.search(line)
        metrics = run_dir / "metrics.jsonl"
        completed = len(metrics.read_text().splitlines()) if metrics.is_file() else None
        return {"status": "diverged", "round": int(match.group(1)) if match else completed, "message": line}
    return {"status": "failed", "message": line}


def verdict(runs: dict[str, dict[str, Any]]) -> list[str]:
    """The page's verdict: which shipped configs, as shipped now, complete at every acceptance seed.

    Only rows at the config's current sha count, and only budgets without extra flags (an extra
    flag is a deliberate variant, such as FD's HtFLlib loss, not the shipped config).
    """
    complete, unstable, incomplete = [], [], []
    configs = shipped_configs()
    for config in configs:
        sha = config_sha(config)  # once per config: the file is read, not every row
        current = [
            e for e in runs.values() if e["config"] == config and e.get("config_sha") == sha and "`" not in e["budget"]
        ]
        bad = [f"seed {e['seed']} at {e['budget']}: {e['status']}" for e in current if e["status"] != "ok"]
        ok_seeds: dict[str, set[int]] = {}
        for e in current:
            if e["status"] == "ok":
                ok_seeds.setdefault(e["budget"], set()).add(e["seed"])
        if bad:
            unstable.append(f"{config} ({'; '.join(bad)})")
        elif any(set(ACCEPTANCE_SEEDS) <= seeds for seeds in ok_seeds.values()):
            complete.append(config)
        else:
            incomplete.append(config)
    seeds = f"{ACCEPTANCE_SEEDS[0]}-{ACCEPTANCE_SEEDS[-1]}"
    lines = [
        "## Verdict",
        "",
        f"Configs as shipped now (rows at the current `config sha`, budgets without extra flags), seeds {seeds}:",
        "",
        f"- complete at every seed under one budget: **{len(complete)} of {len(configs)}**",
        f"- diverged or failed at some seed: {', '.join(unstable) or 'none'}",
        f"- not yet run at every seed: {', '.join(incomplete) or 'none'}",
        "",
    ]
    return lines


def write_page(results: dict[str, Any]) -> None:
    """``stability.json`` (every recorded run) and the page listing every shipped config."""
    write_atomic(RESULTS / "stability.json", json.dumps(results, indent=2, sort_keys=True) + "\n")
    runs: dict[str, dict[str, Any]] = results["runs"]
    lines = [
        "# Stability of the shipped Digits configs",
        "",
        "Generated by `reproductions/stability.py` (do not edit by hand). Every",
        "`configs/experiments/{digits,digits_dir,digits_path}/*.yaml` at several seeds, one single-threaded",
        "process per run; a run *diverged* when the round loop stopped it on a non-finite training loss or",
        "upload (the round given is its 0-based index),",
        "*failed* on any other error. Configs marked *not run* were not run by any invocation yet. The",
        "`config sha` column is the first 10 hex digits of the SHA-256 of the config file when the row",
        "was recorded, so a row that predates a change of its config is visible.",
        "",
        *verdict(runs),
        "## Configs",
        "",
        "| config | budget | seeds run | completed | diverged (seed: round) | failed |",
        "|---|---|---|---|---|---|",
    ]
    for config in shipped_configs():
        entries = {key: value for key, value in runs.items() if value["config"] == config}
        if not entries:
            lines.append(f"| {config} | - | not run | - | - | - |")
            continue
        by_budget: dict[str, list[dict[str, Any]]] = {}
        for entry in entries.values():
            by_budget.setdefault(entry["budget"], []).append(entry)
        for budget, group in sorted(by_budget.items()):
            group.sort(key=lambda e: e["seed"])
            seeds = ", ".join(str(e["seed"]) for e in group)
            ok = sum(e["status"] == "ok" for e in group)
            diverged = ", ".join(f"{e['seed']}: {e.get('round')}" for e in group if e["status"] == "diverged") or "-"
            failed = ", ".join(str(e["seed"]) for e in group if e["status"] == "failed") or "-"
            lines.append(f"| {config} | {budget} | {seeds} | {ok} of {len(group)} | {diverged} | {failed} |")
    lines += ["", "## Runs", "", "| config | seed | budget | status | final metrics or message | config sha | date |"]
    lines.append("|---|---|---|---|---|---|---|")
    for entry in sorted(runs.values(), key=lambda e: (e["config"], e["budget"], e["seed"])):
        final = entry.get("final", {})
        detail = (
            ", ".join(f"{k} {final[k]:.2f}" for k in HEADLINE if k in final)
            if entry["status"] == "ok"
            else entry.get("message", "")
        )
        sha = entry.get("config_sha", "-")
        cells = (entry["config"], entry["seed"], entry["budget"], entry["status"], detail, sha, entry["date"])
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    notes = results.get("notes", [])
    if notes:
        lines += ["", "## Notes"]
        for note in notes:
            lines += ["", note]
    write_atomic(RESULTS / "stability.md", "\n".join(lines) + "\n")


def main() -> None:
    """Run the selected configs at the seeds, then rewrite the page from every recorded run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--only", nargs="*", default=[], help="keep configs whose folder/name contains one of these")
    parser.add_argument("--rounds", type=int, default=None, help="override every config's rounds (default: its own)")
    parser.add_argument("--max-epochs", type=int, default=None, help="override the local epochs per round")
    parser.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="evaluate every N rounds (the last round always is); evaluation does not change training, and "
        "skipping it halves a 20-round digits_dir run",
    )
    parser.add_argument("--jobs", type=int, default=1, help="single-threaded runs at once")
    parser.add_argument(
        "--extra", action="append", default=[], help="one more fedhet fit flag, as --extra=--key=value (repeatable)"
    )
    parser.add_argument("--note", default=None, help="a line added to the page's notes")
    parser.add_argument("--root", type=Path, default=REPO / "runs" / "stability")
    args = parser.parse_args()

    configs = [c for c in shipped_configs() if not args.only or any(s in c for s in args.only)]
    if not configs:
        raise SystemExit(f"no shipped config matches --only {args.only}")
    flags = budget_flags(args.rounds, args.max_epochs, tuple(args.extra), args.eval_every)
    budget = budget_name(args.rounds, args.max_epochs, tuple(args.extra), args.eval_every)
    suffix = "" if not flags else "_" + "_".join(re.sub(r"[^A-Za-z0-9]+", "", f) for f in flags)
    runs = [
        Run(f"{config}{suffix}", f"configs/experiments/{config}.yaml", seed, flags)
        for config in configs
        for seed in args.seeds
    ]
    env = child_environment(1, {"WANDB_MODE": "disabled"})
    run_cells(runs, args.root, args.jobs, env=env, cwd=REPO)

    path = RESULTS / "stability.json"
    results = json.loads(path.read_text()) if path.is_file() else {"runs": {}}
    today = time.strftime("%Y-%m-%d", time.gmtime())
    for run, config in ((r, r.config[len("configs/experiments/") : -len(".yaml")]) for r in runs):
        entry = {"config": config, "seed": run.seed, "budget": budget, "date": today, "config_sha": config_sha(config)}
        entry.update(outcome(run, args.root))
        results["runs"][f"{config}|{budget}|{run.seed}"] = entry
        print(f"{config} seed {run.seed}: {entry['status']}")
    if args.note and args.note not in results.setdefault("notes", []):
        results["notes"].append(args.note)
    write_page(results)


if __name__ == "__main__":
    main()
