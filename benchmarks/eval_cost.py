"""Evaluation cost with many clients: fit vs evaluation seconds per round, 200-client FedAvg at 10%.

Reproduces the issue "with 200 clients at 10% participation (tiny model, MNIST), evaluation
takes 6.9 s of a 7.2 s round". Runs, in this process::

    fedhet fit --config <tree>/configs/experiments/digits_dir/fedavg.yaml
        --scenario.init_args.num_clients 200
        --scenario.init_args.partitioner.init_args.beta 0.5
        --scenario.init_args.partitioner.init_args.min_size 2
        --scenario.init_args.batch_size 32 --scenario.init_args.image_size 28
        --federation.participation 0.1 --models tiny_homo (cnn_tiny, ~1.5k parameters)
        --trainer.max_epochs 1 --trainer.accelerator cpu --rounds 3 --seed 0
        --wandb.mode disabled --run_dir <tmp> [EXTRA ...]

and reads the per-round records the round loop writes to ``<run_dir>/metrics.jsonl``:
``time/fit_s`` (sampling, downloads and the participants' local fits), ``time/eval_s`` (the
evaluation block) and ``time/round_s`` (everything; the rest is upload validation, aggregation and
bookkeeping). It prints one line per round, the means, the ratio eval/fit, and a markdown table
row. The scenario is the shipped label-skew one (embedded MNIST: 2,000 images, of which 500
global test and 250 global validation, 1,250 left for the clients); Dirichlet(0.1) cannot give
200 clients a sample each out of 1,250, hence beta 0.5 and ``min_size`` 2 (about 6 images per
client before the local test/validation splits). With more than 50 clients fedhet's ``auto``
state store keeps client states on disk under the run directory (as a user's run would).

Threads are pinned to one (``OMP_NUM_THREADS=1``, ``MKL_NUM_THREADS=1``, ``torch.set_num_threads(1)``);
W&B is disabled; the embedded data cache is ``$FEDHET_CACHE`` (or ``--cache_dir``).

Usage::

    cd /work/wt-base && PYTHONPATH=/work/wt-base python /work/main/benchmarks/eval_cost.py
    python benchmarks/eval_cost.py --extra "--federation.eval_clients participants"
    python benchmarks/eval_cost.py --rounds 5 -- --federation.eval_every 1   # flags after -- pass through too

Options: ``--clients 200 --participation 0.1 --rounds 3 --batch_size 32 --epochs 1 --models tiny_homo
--beta 0.5 --min_size 2 --seed 0 --label TEXT --keep_run DIR --cache_dir DIR``.
"""

from __future__ import annotations

import os

for _key, _value in (
    ("OMP_NUM_THREADS", "1"),
    ("MKL_NUM_THREADS", "1"),
    ("MKL_DYNAMIC", "FALSE"),
    ("WANDB_MODE", "disabled"),
):
    os.environ[_key] = _value

import argparse  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from statistics import mean  # noqa: E402
from typing import Any  # noqa: E402


def tree_root() -> Path:
    """Root of the fedhet source tree Python imports (the tree being measured)."""
    import fedhet

    return Path(fedhet.__file__).resolve().parents[1]


def git_commit(root: Path) -> str:
    """Short commit of ``root`` (``+dirty`` with uncommitted changes under fedhet/), or ``?``."""
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", "fedhet"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def fit_args(options: argparse.Namespace, run_dir: Path, extra: list[str]) -> list[str]:
    """The ``fedhet fit`` arguments of the measured run."""
    config = tree_root() / "configs" / "experiments" / "digits_dir" / "fedavg.yaml"
    scenario = "--scenario.init_args."
    partitioner = scenario + "partitioner.init_args."
    return [
        "--config", str(config),
        scenario + "num_clients", str(options.clients),
        partitioner + "beta", str(options.beta),
        partitioner + "min_size", str(options.min_size),
        scenario + "batch_size", str(options.batch_size),
        scenario + "image_size", str(options.image_size),
        "--federation.participation", str(options.participation),
        "--models", options.models,
        "--trainer.max_epochs", str(options.epochs),
        "--trainer.accelerator", "cpu",
        "--rounds", str(options.rounds),
        "--seed", str(options.seed),
        "--wandb.mode", "disabled",
        "--run_dir", str(run_dir),
        *extra,
    ]  # fmt: skip


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """Per-round metrics records of a finished run."""
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


class CpuClock:
    """Round observer: this process's CPU seconds between consecutive round ends.

    The loop's ``time/*`` records are wall-clock; on a shared machine a process also waits for a
    core, so CPU time tells how much of a wall second was work. The first interval starts at
    ``fit()`` and includes setup; it also includes the run directory's per-round writes.
    """

    def __init__(self) -> None:
        self.last = time.process_time()
        self.rounds: list[float] = []

    def on_round_end(self, loop: Any, record: dict[str, Any]) -> None:
        now = time.process_time()
        self.rounds.append(now - self.last)
        self.last = now

    def on_run_end(self, loop: Any, summary: dict[str, Any]) -> None:
        """Nothing to do at the end."""


def call_fit(args: list[str], clock: CpuClock) -> dict[str, Any]:
    """``fedhet.cli.fit(args)`` with the CPU clock as an extra observer when ``fit`` accepts callbacks."""
    import inspect

    from fedhet.cli import fit

    if "callbacks" in inspect.signature(fit).parameters:
        return fit(args, callbacks=[clock])
    return fit(args)


def measure(
    options: argparse.Namespace, extra: list[str]
) -> tuple[list[dict[str, Any]], dict[str, Any], float, float, CpuClock]:
    """Run the experiment; return its round records, summary, total wall and CPU seconds, and the CPU clock."""
    import torch

    torch.set_num_threads(1)
    root = options.keep_run if options.keep_run is not None else Path(tempfile.mkdtemp(prefix="eval-cost-"))
    run_dir = root / "run"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    args = fit_args(options, run_dir, extra)
    print("fedhet fit " + " ".join(shlex.quote(a) for a in args), flush=True)
    try:
        started, cpu_started = time.perf_counter(), time.process_time()
        clock = CpuClock()
        summary = call_fit(args, clock)
        wall_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
        records = read_records(run_dir)
    finally:
        if options.keep_run is None:
            shutil.rmtree(root, ignore_errors=True)
    return records, summary, wall_s, cpu_s, clock


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split ``argv`` at a bare ``--``: our options before it, fedhet flags after it."""
    if "--" in argv:
        index = argv.index("--")
        return argv[:index], argv[index + 1 :]
    return argv, []


def table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table."""
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def _acc(record: dict[str, Any], key: str) -> str:
    return f"{record[key]:.2f}" if key in record else "-"


def print_report(
    records: list[dict[str, Any]],
    summary: dict[str, Any],
    wall_s: float,
    cpu_s: float,
    clock: CpuClock,
    options: argparse.Namespace,
    label: str,
    extra: list[str],
) -> None:
    """Per-round timings, the means and ratio eval/fit, and one markdown row for a results table."""
    rows = []
    for index, r in enumerate(records):
        other = r["time/round_s"] - r["time/fit_s"] - r["time/eval_s"]
        cpu = f"{clock.rounds[index]:.3f}" if index < len(clock.rounds) else "-"
        cpu += " (incl. setup)" if index == 0 and clock.rounds else ""
        times = [r["time/fit_s"], r["time/eval_s"], other, r["time/round_s"]]
        rows.append(
            [
                str(r["round"] + 1),
                str(r["clients"]),
                *(f"{t:.3f}" for t in times),
                cpu,
                _acc(r, "acc_local"),
                _acc(r, "acc_global"),
            ]
        )
    header = [
        "round",
        "clients",
        "fit s",
        "eval s",
        "other s",
        "round s",
        "CPU s since last round end",
        "acc_local",
        "acc_global",
    ]
    print("\n" + table(header, rows))

    fit_s = mean(r["time/fit_s"] for r in records)
    eval_s = mean(r["time/eval_s"] for r in records)
    round_s = mean(r["time/round_s"] for r in records)
    print(
        f"\nmean per round over {len(records)} rounds: fit {fit_s:.3f} s, eval {eval_s:.3f} s, round {round_s:.3f} s; "
        f"eval/fit {eval_s / fit_s:.2f}; eval share of round {100 * eval_s / round_s:.0f}%; "
        f"total fit() wall {wall_s:.1f} s, CPU {cpu_s:.1f} s (incl. setup; CPU/wall {cpu_s / wall_s:.2f}, "
        "well below 1 means the process waited for a core)"
    )
    if len(records) > 1:
        later = records[1:]
        fit_later, eval_later = mean(r["time/fit_s"] for r in later), mean(r["time/eval_s"] for r in later)
        round_later = mean(r["time/round_s"] for r in later)
        print(
            f"rounds 2..{len(records)} only: fit {fit_later:.3f} s, eval {eval_later:.3f} s, round {round_later:.3f} s"
        )

    header = ["tree", "clients", "part.", "models", "rounds", "fit s/round", "eval s/round", "round s", "eval/fit"]
    header += ["eval share", "acc_local", "acc_global", "extra"]
    final = summary["final"]
    row = [label, str(options.clients), f"{options.participation:g}", options.models, str(len(records))]
    row += [
        f"{fit_s:.3f}",
        f"{eval_s:.3f}",
        f"{round_s:.3f}",
        f"{eval_s / fit_s:.2f}",
        f"{100 * eval_s / round_s:.0f}%",
    ]
    row += [_acc(final, "acc_local"), _acc(final, "acc_global"), " ".join(extra) or "-"]
    print("\n" + table(header, [row]))


def main(argv: list[str] | None = None) -> int:
    """Parse the options, run the experiment, print the report; 2 on a fedhet error."""
    own, passthrough = split_passthrough(list(sys.argv[1:] if argv is None else argv))
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--participation", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--image_size", type=int, default=28)
    parser.add_argument("--epochs", type=int, default=1, help="local epochs per round")
    parser.add_argument(
        "--models", default="tiny_homo", help="model family or name (tiny_homo = cnn_tiny on every client)"
    )
    parser.add_argument("--beta", type=float, default=0.5, help="Dirichlet concentration")
    parser.add_argument("--min_size", type=int, default=2, help="Dirichlet partitioner min_size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--extra", action="append", default=[], help="extra fedhet fit flags, one shell-quoted string (repeatable)"
    )
    parser.add_argument("--label", default=None, help="first cell of the table row (default: tree@commit)")
    parser.add_argument("--keep_run", type=Path, default=None, help="keep the run directory under this folder")
    parser.add_argument(
        "--cache_dir", type=Path, default=None, help="FEDHET_CACHE (default: $FEDHET_CACHE or fedhet's default)"
    )
    options = parser.parse_args(own)
    if options.cache_dir is not None:
        os.environ["FEDHET_CACHE"] = str(options.cache_dir.expanduser().resolve())
    extra = [token for item in options.extra for token in shlex.split(item)] + passthrough

    root = tree_root()
    label = options.label or f"{root.name}@{git_commit(root)}"
    print(f"fedhet tree: {root} ({git_commit(root)}); FEDHET_CACHE={os.environ.get('FEDHET_CACHE', '(default)')}")
    from fedhet.errors import FedhetError

    try:
        records, summary, wall_s, cpu_s, clock = measure(options, extra)
    except FedhetError as exc:  # e.g. an --extra flag this tree does not know
        print(f"eval_cost: error: {exc}", file=sys.stderr)
        return 2

    print_report(records, summary, wall_s, cpu_s, clock, options, label, extra)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
