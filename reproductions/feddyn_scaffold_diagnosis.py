"""Why FedDyn and SCAFFOLD trail FedAvg on ``configs/experiments/digits_dir`` (issue 32): a short diagnostic.

On the shipped 20-round configs FedDyn ends at 10-20 % and SCAFFOLD at 28-36 % where FedAvg reaches
69 %. The code was checked against the papers' update rules (tests in
``tests/algorithms/test_feddyn.py`` and ``test_scaffold.py``); this script measures whether the gap
is a setting: a few rounds of each folder config with one knob changed at a time:

* FedAvg as shipped (SGD 0.05, momentum 0.9) and with momentum 0 (SCAFFOLD's optimizer);
* SCAFFOLD as shipped (SGD 0.05, momentum 0: option II needs plain SGD) and at lr 0.5 (about the
  step length of momentum 0.9 at 0.05, ``0.05 / (1 - 0.9)``);
* FedDyn with ``alpha`` in {0.001, 0.01, 0.1} (momentum 0.9 as shipped), at the shipped
  ``alpha = 0.01`` with momentum 0, and with momentum 0 at lr 0.5 (``alpha`` 0.01 and 0.1).

    python reproductions/feddyn_scaffold_diagnosis.py [--rounds 5] [--seed 0] [--arms NAME ...]

Each arm is one ``python -m fedhet fit`` subprocess (under ``flock $FEDHET_CPU_LOCK`` when that
variable names a lock file, so a shared machine runs one at a time). Writes
``docs/results/feddyn_scaffold_diagnosis.json`` (``acc_server`` per round per arm, one table per
``rounds``/``seed`` budget; arms merged into an existing file) and prints one line per arm. The
verdict is in ``docs/diagnoses.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fedhet.files import atomic_write_text  # noqa: E402

FOLDER = "configs/experiments/digits_dir"
OUT = Path(os.environ.get("FEDHET_DIAGNOSIS_OUT", REPO / "docs" / "results")) / "feddyn_scaffold_diagnosis.json"

#: name -> (config file, overrides)
ARMS: dict[str, tuple[str, list[str]]] = {
    "fedavg": ("fedavg.yaml", []),
    "fedavg_momentum0": ("fedavg.yaml", ["--method.init_args.momentum=0.0"]),
    "scaffold": ("scaffold.yaml", []),
    "scaffold_lr0.5": ("scaffold.yaml", ["--method.init_args.lr=0.5"]),
    "feddyn_alpha0.001": ("feddyn.yaml", ["--method.init_args.alpha=0.001"]),
    "feddyn_alpha0.01": ("feddyn.yaml", ["--method.init_args.alpha=0.01"]),
    "feddyn_alpha0.1": ("feddyn.yaml", ["--method.init_args.alpha=0.1"]),
    "feddyn_alpha0.01_momentum0": ("feddyn.yaml", ["--method.init_args.momentum=0.0"]),
    "feddyn_alpha0.01_momentum0_lr0.5": (
        "feddyn.yaml", ["--method.init_args.momentum=0.0", "--method.init_args.lr=0.5"]
    ),
    "feddyn_alpha0.1_momentum0_lr0.5": (
        "feddyn.yaml", ["--method.init_args.momentum=0.0", "--method.init_args.lr=0.5", "--method.init_args.alpha=0.1"]
    ),
}


def run_arm(name: str, rounds: int, seed: int) -> dict[str, object]:
    """One arm: its per-round ``acc_server`` and ``acc_global`` read from the run's metrics.jsonl."""
    config, overrides = ARMS[name]
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        command = [
            sys.executable, "-m", "fedhet", "fit", "--config", f"{FOLDER}/{config}", f"--rounds={rounds}",
            f"--seed={seed}", f"--run_dir={run_dir}", "--wandb.mode=disabled", *overrides,
        ]
        lock = os.environ.get("FEDHET_CPU_LOCK")
        if lock:
            command = ["flock", lock, *command]
        env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        started = time.perf_counter()
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"arm {name} failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evaluated = [r for r in rows if "acc_server" in r]
    return {
        "config": f"{FOLDER}/{config}",
        "overrides": overrides,
        "acc_server": [round(float(r["acc_server"]), 2) for r in evaluated],
        "acc_global": [round(float(r.get("acc_global", float("nan"))), 2) for r in evaluated],
        "train_loss": [round(float(r.get("train/loss", float("nan"))), 4) for r in evaluated],
        "wall_s": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    """Run the chosen arms (each under the lock when asked), merge them into the json, print a line each."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    args = parser.parse_args()
    everything = json.loads(OUT.read_text()) if OUT.exists() else {}
    budget = f"rounds={args.rounds} seed={args.seed}"  # one table per budget, arms merged within it
    arms = everything.setdefault(budget, {})
    for name in args.arms:
        arms[name] = run_arm(name, args.rounds, args.seed)
        atomic_write_text(OUT, json.dumps(everything, indent=1))
        print(f"{name:28s} acc_server {arms[name]['acc_server']}  ({arms[name]['wall_s']} s)", flush=True)


if __name__ == "__main__":
    main()
