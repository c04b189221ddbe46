"""Parallel clients on one machine: sequential (1 and 2 intra-op threads) vs 2 workers x 1 thread.

The workload is the small-model, batch-10 regime of many-client FL (HtFLlib's setting): FedAvg on
the embedded label-skew scenario (MNIST at 3x32x32, 20 clients, Dirichlet 0.1), one local epoch,
SGD. Every executor runs the same loop on the same data; all loops are built first (Ray and the
process pool started once, their start-up timed apart) and then their rounds are *interleaved*
(round r of every executor, then round r+1 ...) so drifting machine load hits all of them alike.
No round evaluates (the loops are configured one round longer than timed), so the round time is
client training plus the loop's own work (uploads, aggregation), the part executors change.

Ratios are against ``sequential, 2 threads`` measured in the same run (the fastest sequential
setting on an idle 2-core machine). The 1-thread executors must end with bitwise-identical
global weights (per-client seeding): the script checks it. The last line is the headline, e.g.
``batch 10: ray (2 workers x 1 thread) / sequential (2 threads) round time ratio 0.62``.

Run (on an otherwise idle machine; note ``uptime``)::

    OMP_NUM_THREADS=2 python benchmarks/parallel_clients.py [--model cnn_tiny] [--batch_sizes 10 64]
        [--rounds 4] [--executors seq1 seq2 process ray]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time

import torch

from fedhet.algorithms import FedAvg
from fedhet.data import DirichletPartitioner, LabelSkewScenario
from fedhet.federation import FederationLoop, FederationSettings, ProcessExecutor, SequentialExecutor
from fedhet.federation.trainer import TrainerTemplate, silence_lightning

LABELS = {
    "seq1": "sequential (1 thread)",
    "seq2": "sequential (2 threads)",
    "process": "process (2 workers x 1 thread)",
    "ray": "ray (2 workers x 1 thread)",
}
REFERENCE = "seq2"


def build_scenario(clients: int, batch_size: int, image_size: int) -> LabelSkewScenario:
    """The embedded MNIST label-skew scenario, Dirichlet 0.1 over ``clients`` clients."""
    scenario = LabelSkewScenario(
        dataset="mnist",
        num_clients=clients,
        partitioner=DirichletPartitioner(beta=0.1, min_size=10),
        global_test_size=100,
        global_val_size=50,
        local_test_fraction=0.1,
        image_size=image_size,
        batch_size=batch_size,
        seed=0,
    )
    scenario.setup()
    return scenario


def build_executor(name: str, workers: int):
    """The executor a configuration name stands for."""
    if name == "process":
        return ProcessExecutor(workers=workers, threads_per_worker=1)
    if name == "ray":
        from fedhet.federation import RayExecutor

        return RayExecutor(workers=workers, threads_per_worker=1)
    return SequentialExecutor()


def driver_threads(name: str) -> int:
    """Intra-op threads of the driver while ``name`` runs its round (workers set their own)."""
    return 2 if name == "seq2" else 1


def load() -> str:
    """The machine's load averages (other users' work shows here)."""
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_batch_size(args: argparse.Namespace, batch_size: int) -> dict[str, float]:
    """Build every executor's loop, interleave their timed rounds; median round time per executor."""
    scenario = build_scenario(args.clients, batch_size, args.image_size)
    steps = sum(len(scenario.train_loader(c, 0)) for c in range(scenario.num_clients))
    images = sum(len(scenario.client_data(c).train) for c in range(args.clients))
    print(
        f"\nbatch {batch_size}: FedAvg, {args.clients} clients ({images} training images), {args.model}, "
        f"{steps} local steps per round, {args.image_size}px, {load()}"
    )
    loops: dict[str, FederationLoop] = {}
    try:
        for name in args.executors:
            torch.set_num_threads(driver_threads(name))
            started = time.perf_counter()
            loops[name] = FederationLoop(
                FedAvg(lr=0.01),
                scenario,
                [args.model] * args.clients,
                TrainerTemplate(max_epochs=1, accelerator="cpu"),
                rounds=args.rounds + 2,
                seed=0,
                settings=FederationSettings(eval_every=args.rounds + 3, executor=build_executor(name, args.workers)),
            )
            print(f"  {LABELS[name]:34s} start-up {time.perf_counter() - started:6.2f} s")
        times: dict[str, list[float]] = {name: [] for name in loops}
        for round_idx in range(args.rounds + 1):  # round 0 warms up (modules built on first use)
            for name, loop in loops.items():
                torch.set_num_threads(driver_threads(name))
                started = time.perf_counter()
                loop.run_round(round_idx)
                loop.next_round = round_idx + 1
                if round_idx > 0:
                    times[name].append(time.perf_counter() - started)
        medians = {name: statistics.median(values) for name, values in times.items()}
        reference = medians.get(REFERENCE)
        for name, median in medians.items():
            ratio = f"  ratio {median / reference:5.2f}" if reference else ""
            rounds = " ".join(f"{t:.2f}" for t in times[name])
            print(f"  {LABELS[name]:34s} round {median:6.2f} s (median; rounds {rounds}){ratio}")
        single = [name for name in loops if driver_threads(name) == 1 or name in ("process", "ray")]
        if len(single) > 1:
            base = loops[single[0]].server.global_weights
            same = all(
                all(torch.equal(base[k], loops[name].server.global_weights[k]) for k in base) for name in single[1:]
            )
            print(f"  global weights after {args.rounds + 1} rounds identical across {', '.join(single)}: {same}")
        print(f"  {load()}")
        return medians
    finally:
        for loop in loops.values():
            loop.executor.shutdown()


def main() -> None:
    """Parse the arguments, run each batch size, print the headline ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn_tiny")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[10])
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds (after one warm-up round)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--executors", nargs="+", choices=list(LABELS), default=list(LABELS))
    args = parser.parse_args()
    os.environ.setdefault("MKL_DYNAMIC", "FALSE")
    silence_lightning()
    logging.getLogger("fedhet").setLevel(logging.WARNING)
    print(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    headline = []
    for batch_size in args.batch_sizes:
        medians = run_batch_size(args, batch_size)
        if REFERENCE in medians:
            headline += [
                f"batch {batch_size}: {LABELS[name]} / {LABELS[REFERENCE]} round time ratio "
                f"{medians[name] / medians[REFERENCE]:.2f}"
                for name in ("ray", "process")
                if name in medians
            ]
    print()
    print("; ".join(headline))


if __name__ == "__main__":
    main()
