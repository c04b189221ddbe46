"""Round time on a GPU against one CPU core, for the same config and seed (same machine, same run).

Each config runs twice through ``fedhet fit``, once per accelerator (``--trainer.accelerator``),
one run after the other so the timings do not share the machine; the CPU run is single-threaded,
like every other CPU benchmark here. The round loop logs ``time/round_s`` (client fits plus
evaluation) for every federated round; the ratio of the sums is the speed-up. The accuracies are
printed beside it: a GPU run does not repeat the CPU run's numbers bit for bit (other kernels), but
it must land close to it.

Run (on a machine with a CUDA GPU):
``python benchmarks/accelerator_round.py --configs configs/experiments/digits/fedproto.yaml
configs/experiments/mnist_vtc/fedvtc.yaml --json docs/results/accelerator_round.json``.
``--accelerators cpu`` alone checks the script on a machine without one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reproductions"))  # comparison.py lives there
from comparison import REPO, Run, execute, load, write_atomic  # noqa: E402

ACCURACY_KEYS = ("acc_intra", "acc_inter", "acc_global", "acc_local")


def measure(config: str, accelerator: str, root: Path, rounds: int | None) -> dict[str, Any]:
    """Run ``config`` on ``accelerator`` (reusing a complete run) and sum its federated rounds' times."""
    # one process: a config's parallel executor (mnist_vtc's two workers) would time several cores or GPU users
    flags = (f"--trainer.accelerator={accelerator}", "--federation.eval_every=1", "--federation.executor=sequential")
    flags += ("--rounds", str(rounds)) if rounds else ()
    run = Run(f"{Path(config).stem}/{accelerator}", config, 0, flags)
    execute([run], root)
    summary = load(run, root)
    federated = [r for r in summary["history"] if "phase" not in r and "time/round_s" in r]
    final = summary["final"]
    return {
        "rounds": len(federated),
        **{key: round(sum(r[f"time/{key}"] for r in federated), 3) for key in ("round_s", "fit_s", "eval_s")},
        **{key: final[key] for key in ACCURACY_KEYS if key in final},
    }


def main() -> None:
    """Measure every config on every accelerator and print the speed-ups against the first."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["configs/experiments/digits/fedproto.yaml"])
    parser.add_argument("--accelerators", nargs="+", default=["cpu", "gpu"], help="the first is the reference")
    parser.add_argument("--rounds", type=int, default=None, help="override the configs' rounds")
    parser.add_argument("--root", type=Path, default=REPO / "runs" / "accelerator_round")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if any(a in ("gpu", "cuda") for a in args.accelerators) and not torch.cuda.is_available():
        raise SystemExit("accelerator_round: no CUDA GPU on this machine; run it where there is one, "
                         "or pass --accelerators cpu")
    results: dict[str, dict[str, Any]] = {}
    for config in args.configs:
        rows = {accelerator: measure(config, accelerator, args.root, args.rounds) for accelerator in args.accelerators}
        reference = rows[args.accelerators[0]]
        for accelerator, row in rows.items():
            for key in ("round_s", "fit_s", "eval_s"):
                row[f"{key}_speedup"] = round(reference[key] / row[key], 2) if row[key] else None
            accuracy = "  ".join(f"{k} {row[k]:.2f}" for k in ACCURACY_KEYS if k in row)
            speedups = f"x{row['round_s_speedup']}  fit x{row['fit_s_speedup']}  eval x{row['eval_s_speedup']}"
            print(f"{config:48s} {accelerator:4s} {row['rounds']:3d} rounds  round {row['round_s']:8.1f} s "
                  f"({speedups})  {accuracy}")
        results[config] = rows
    if args.json:
        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu only"
        record = {"device": device, "torch": torch.__version__, "results": results}
        write_atomic(args.json, json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
