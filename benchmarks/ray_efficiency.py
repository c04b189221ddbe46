"""Ray's parallel efficiency: client-step throughput with 1 and 2 workers on a compute-bound workload.

Workload: FedAvg with ``simple_cnn`` (FCCL+'s SimpleCNN at CPU size, 78k parameters) on the
embedded MNIST label-skew scenario at 3x32x32, ``--clients`` clients of an IID split, each running
exactly ``--local_steps`` SGD steps of batch ``--batch_size`` per round: equal tasks, so the
workers are balanced and any shortfall is Ray's and the loop's, not the partition's. No round is
evaluated (the loop is configured longer than it runs), so a round is client training, the
transfers of states and downloads, and FedAvg's aggregation.

Each worker count runs in a child process of its own with its own local Ray instance (actors of
one CPU and one intra-op thread; the driver one thread), one after the other in one invocation.
Round 0 is a warm-up. Throughput is local steps per second of the timed rounds (median round);
the parallel efficiency of ``n`` workers is ``throughput(n) / (n * throughput(1))`` and the
efficiency per added worker ``(throughput(n) - throughput(n - 1)) / throughput(1)``. ``--workers
1 2 3 4`` measures more points on a larger machine. The last line is the headline, e.g.
``parallel efficiency 0.91`` (of the largest worker count).

Run on an otherwise idle machine (about 3 minutes on 2 cores; ``uptime`` first; efficiency
needs as many free cores as workers)::

    python benchmarks/ray_efficiency.py [--workers 1 2] [--rounds 3]

A quick end-to-end check (numbers meaningless)::

    python benchmarks/ray_efficiency.py --clients 4 --local_steps 2 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from _measure import load, peak_rss_gb, ray_worker_pids, report, run_child


def run_configuration(workers: int, args: argparse.Namespace) -> dict:
    """Build the loop on ``workers`` Ray actors, run the warm-up and timed rounds, measure."""
    import torch

    from fedhet.algorithms import FedAvg
    from fedhet.data import IIDPartitioner, LabelSkewScenario
    from fedhet.federation import FederationLoop, FederationSettings, RayExecutor
    from fedhet.federation.trainer import TrainerTemplate, silence_lightning

    torch.set_num_threads(1)
    silence_lightning()
    scenario = LabelSkewScenario(
        dataset="mnist",
        num_clients=args.clients,
        partitioner=IIDPartitioner(),
        global_test_size=100,
        global_val_size=50,
        image_size=32,
        batch_size=args.batch_size,
        seed=0,
    )
    scenario.setup()
    started = time.perf_counter()
    loop = FederationLoop(
        FedAvg(lr=0.01),
        scenario,
        [args.model] * args.clients,
        TrainerTemplate(max_steps=args.local_steps, accelerator="cpu"),
        rounds=args.rounds + 2,
        seed=0,
        settings=FederationSettings(
            eval_every=args.rounds + 3,
            executor=RayExecutor(workers=workers, cpus_per_worker=1.0, threads_per_worker=1),
        ),
    )
    startup_s = time.perf_counter() - started
    rounds = []
    try:
        for round_idx in range(args.rounds + 1):
            round_started = time.perf_counter()
            loop.run_round(round_idx)
            loop.next_round = round_idx + 1
            if round_idx > 0:
                rounds.append(time.perf_counter() - round_started)
        worker_rss = [peak_rss_gb(pid) for pid in ray_worker_pids()]
    finally:
        loop.executor.shutdown()
    return {
        "workers": workers,
        "round_s": rounds,
        "steps_per_round": args.clients * args.local_steps,
        "startup_s": round(startup_s, 2),
        "driver_peak_rss_gb": round(peak_rss_gb(), 3),
        "worker_peak_rss_gb": [round(x, 3) for x in worker_rss],
    }


def main() -> None:
    """Run every worker count (children), print throughput and efficiencies, then the headline."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--clients", type=int, default=8, help="a multiple of every worker count balances them")
    parser.add_argument("--local_steps", type=int, default=40)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--model", default="simple_cnn")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up round")
    parser.add_argument("--json", default=None, help="also write the measurements here")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        report(run_configuration(args.child, args))
        return
    if 1 not in args.workers:
        parser.error("--workers must include 1 (the reference throughput)")

    print(f"{os.cpu_count()} CPUs; {load()}")
    print(
        f"FedAvg, {args.model}, {args.clients} clients x {args.local_steps} steps of batch {args.batch_size} "
        f"(3x32x32), Ray actors of 1 CPU x 1 thread, {args.rounds} timed rounds after a warm-up, no evaluation"
    )
    results = {}
    for workers in sorted(args.workers):
        options = ["--child", str(workers), "--clients", str(args.clients), "--local_steps", str(args.local_steps)]
        options += ["--batch_size", str(args.batch_size), "--model", args.model, "--rounds", str(args.rounds)]
        results[workers] = run_child(__file__, options, 1, f"{workers} workers")
        rounds = " ".join(f"{t:.2f}" for t in results[workers]["round_s"])
        print(f"  {workers} worker(s): rounds {rounds} s, start-up {results[workers]['startup_s']:.1f} s; {load()}")
    throughput = {w: r["steps_per_round"] / statistics.median(r["round_s"]) for w, r in results.items()}
    print()
    print("| workers | round s (median) | steps / s | speed-up | parallel efficiency | gain of the added worker |")
    print("|---|---|---|---|---|---|")
    previous = None
    for workers in sorted(results):
        speedup = throughput[workers] / throughput[1]
        added = "" if previous is None else f"{(throughput[workers] - throughput[previous]) / throughput[1]:.2f}"
        print(
            f"| {workers} | {statistics.median(results[workers]['round_s']):.2f} | {throughput[workers]:.1f} "
            f"| {speedup:.2f} | {speedup / workers:.2f} | {added} |"
        )
        previous = workers
    print(f"\n{load()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1) + "\n")
    largest = max(results)
    print(f"parallel efficiency {throughput[largest] / (largest * throughput[1]):.2f}")


if __name__ == "__main__":
    main()
