"""Rounds per hour on one GPU: fedhet's sequential executor, clients sharing the GPU, and a plain loop.

Three ways of running the same FedProto round, each in a child process of its own, one after the
other on the same device in one invocation:

- ``plain``: a sequential loop written in plain PyTorch the way HtFLlib and PFLlib train: every
  client's model stays on the GPU, batches are copied to it one by one, each client trains one
  local epoch (cross-entropy plus lambda times the MSE of its features to the global prototype of
  their class), computes its class-mean features in eval mode, and is evaluated on its own test
  split; the server takes the count-weighted mean of the prototypes.
- ``seq``: fedhet's round loop with the sequential executor (client state swapped in and out of
  one live module per architecture, Lightning fits), doing the same steps on the same data.
- ``procN``: fedhet's round loop with ``N`` worker processes sharing the one GPU
  (``federation.executor: process``, the pfl-research recipe of several workers per GPU).

Two workloads (``--workloads``): ``htfe8``, HtFLlib's HtFE-img-8 architectures (FedAvgCNN,
GoogLeNet, MobileNetV2, ResNet-18/34/50/101/152) with 512-d features on 3x32x32 inputs, and
``cpu4``, the CPU-sized family of the embedded configs with 64-d features; both on 20 clients
holding the 5,000 embedded MNIST digits (``mnist_all``, upsampled to 3x32x32) split by
Dirichlet(0.1), batch 10, SGD lr 0.01 with gradients clipped at norm 10 (``--clip``), one local
epoch, FedProto lambda 1, every client evaluated every round. A client whose prototypes are not
finite is dropped from the round (fedhet: ``on_invalid_upload: drop``; the plain loop leaves its
prototypes out) and counted (``dropped_uploads``): on an H200, ResNet-101's eval-mode features
overflowed after the first round's few steps, and a timing run must not stop on it. Round 0
warms up (kernels, allocator, workers); ``--rounds`` rounds are timed. Reported per
configuration: median round time, rounds per hour, ratios against ``plain``, peak GPU memory (the
most ``nvidia-smi`` saw in use on the device while the child ran, all processes together) and
mean GPU utilisation (``nvidia-smi`` sampled every 0.2 s).

Run on a GPU machine (about 3 minutes on an H100)::

    python benchmarks/gpu_round.py [--workloads htfe8 cpu4] [--configs plain seq proc4 proc8] [--json out.json]

On a machine without one, ``--device cpu --clients 4 --rounds 1`` checks the script end to end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import MARK, family_architectures, htfllib_scenario, peak_rss_gb, report  # noqa: E402

WORKLOADS = {"htfe8": ("htfe_img_8", 512), "cpu4": ("cpu4", 64)}
LAMBDA = 1.0
LR = 0.01


# ------------------------------------------------------------------------------ the shared set-up
def build_loop(config: str, args: argparse.Namespace) -> Any:
    """The FedProto loop of fedhet on ``args.device`` with the executor ``config`` names."""
    from fedhet.algorithms import FedProto
    from fedhet.federation import FederationLoop, FederationSettings, ProcessExecutor, SequentialExecutor
    from fedhet.federation.trainer import TrainerTemplate

    scenario = htfllib_scenario(args.clients, args.seed)
    archs = family_architectures(WORKLOADS[args.workload][0], args.clients)
    algorithm = FedProto(lam=LAMBDA, lr=LR, momentum=0.0)
    accelerator = "gpu" if args.device == "cuda" else "cpu"
    trainer = TrainerTemplate(
        max_epochs=1, accelerator=accelerator, max_steps=args.max_steps, gradient_clip_val=args.clip
    )
    executor: Any = (
        SequentialExecutor() if config == "seq" else ProcessExecutor(workers=int(config.removeprefix("proc")))
    )
    return FederationLoop(
        algorithm,
        scenario,
        archs,
        trainer,
        rounds=args.rounds + 1,
        seed=args.seed,
        # a client whose prototypes overflow (ResNet-101/152 in eval mode after a few steps on ~190
        # images did, on an H200) is dropped and counted, not a stop: the timing is of the same work
        settings=FederationSettings(executor=executor, on_invalid_upload="drop"),
        feature_dim=WORKLOADS[args.workload][1],
    )


def run_fedhet(config: str, args: argparse.Namespace) -> dict[str, Any]:
    """Time fedhet's rounds (the first is a warm-up) with the executor ``config`` names."""
    loop = build_loop(config, args)
    rounds = []
    try:
        for round_idx in range(args.rounds + 1):
            started = time.perf_counter()
            record = loop.run_round(round_idx)
            elapsed = time.perf_counter() - started
            loop.history.append(record)
            loop.next_round = round_idx + 1
            if round_idx > 0:
                rounds.append(elapsed)
    finally:
        loop.executor.shutdown()
    steps = sum(len(loop.scenario.train_loader(c, 0)) for c in range(args.clients))
    return {"round_s": rounds, "acc_local": loop.history[-1].get("acc_local"), "steps_per_round": steps,
            "dropped_uploads": len(loop.dropped_uploads)}


def run_plain(args: argparse.Namespace) -> dict[str, Any]:
    """The same FedProto round written by hand, every client's model resident on the device."""
    import torch
    import torch.nn.functional as F

    from fedhet.algorithms import FedProto
    from fedhet.federation.runtime import ClientRuntime
    from fedhet.federation.trainer import TrainerTemplate
    from fedhet.seeding import derive_seed

    device = torch.device(args.device)
    scenario = htfllib_scenario(args.clients, args.seed)
    archs = family_architectures(WORKLOADS[args.workload][0], args.clients)
    runtime = ClientRuntime(
        FedProto(lam=LAMBDA),
        scenario,
        archs,
        TrainerTemplate(),
        seed=args.seed,
        feature_dim=WORKLOADS[args.workload][1],
    )
    models = [
        runtime.build_module(arch, derive_seed(args.seed, "init", c)).model.to(device) for c, arch in enumerate(archs)
    ]
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    global_protos: torch.Tensor | None = None
    rounds, accuracy, dropped = [], 0.0, 0
    for round_idx in range(args.rounds + 1):
        started = time.perf_counter()
        sums, counts, correct, seen = None, None, 0, 0
        for client, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            model.train()
            data = scenario.client_data(client)
            for step, (x, y) in enumerate(
                scenario.train_loader(client, derive_seed(args.seed, "fit", round_idx, client))
            ):
                if 0 <= args.max_steps <= step:
                    break
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                features = model.forward_features(x)
                loss = F.cross_entropy(model.forward_head(features), y)
                if global_protos is not None:
                    known = global_protos[y].abs().sum(1) > 0
                    if known.any():
                        loss = loss + LAMBDA * F.mse_loss(features[known], global_protos[y][known])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # what Lightning's clipping does
                optimizer.step()
            model.eval()
            with torch.no_grad():
                own_sums, own_counts = None, None
                for x, y in scenario.eval_loader(data.train):
                    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                    features = model.forward_features(x)
                    if own_sums is None:
                        own_sums = torch.zeros(scenario.num_classes, features.shape[1], device=device)
                        own_counts = torch.zeros(scenario.num_classes, device=device)
                    own_sums.index_add_(0, y, features)
                    own_counts.index_add_(0, y, torch.ones_like(y, dtype=features.dtype))
                # a client whose prototypes are not finite is left out, as fedhet's drop policy does
                if bool(torch.isfinite(own_sums).all()):
                    sums = own_sums if sums is None else sums + own_sums
                    counts = own_counts if counts is None else counts + own_counts
                else:
                    dropped += 1
                for x, y in scenario.eval_loader(data.test):
                    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                    correct += int((model(x).argmax(1) == y).sum())
                    seen += len(y)
        if sums is not None:  # count-weighted mean over the clients kept
            global_protos = sums / counts.clamp(min=1).unsqueeze(1)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if round_idx > 0:
            rounds.append(time.perf_counter() - started)
        accuracy = 100.0 * correct / max(seen, 1)
    steps = sum(len(scenario.train_loader(c, 0)) for c in range(args.clients))
    return {"round_s": rounds, "acc_local": accuracy, "steps_per_round": steps, "dropped_uploads": dropped}


def run_configuration(config: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one configuration in this (child) process and return its measurements."""
    import torch

    from fedhet.federation.trainer import silence_lightning

    silence_lightning()
    started = time.perf_counter()
    result = run_plain(args) if config == "plain" else run_fedhet(config, args)
    return {
        **result,
        "config": config,
        "wall_s": round(time.perf_counter() - started, 2),
        "driver_peak_rss_gb": round(peak_rss_gb(), 3),
        "driver_peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 1e9, 3) if args.device == "cuda" else None,
    }


# ------------------------------------------------------------------------------ the parent
class GpuSampler:
    """``nvidia-smi`` sampled every 0.2 s in a thread: mean utilisation (%) and the most memory in use (GB)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        query = ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits", "-i", "0"]
        while not self._stop.is_set():
            try:
                line = subprocess.run(query, capture_output=True, text=True, timeout=5).stdout.strip()
                utilisation, memory = (float(v) for v in line.split(","))
                self.samples.append((utilisation, memory / 1024))
            except (OSError, ValueError, subprocess.SubprocessError):
                return  # no nvidia-smi (a CPU dry run): nothing to report
            self._stop.wait(0.2)

    def __enter__(self) -> GpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, float | None]:
        if not self.samples:
            return {"gpu_util_mean_pct": None, "gpu_memory_peak_gb": None}
        return {
            "gpu_util_mean_pct": round(statistics.fmean(s[0] for s in self.samples), 1),
            "gpu_memory_peak_gb": round(max(s[1] for s in self.samples), 2),
        }


def spawn(workload: str, config: str, args: argparse.Namespace) -> dict[str, Any]:
    """One configuration in a fresh child process, with the GPU sampled while it runs."""
    options = ["--child", config, "--child_workload", workload, "--clients", str(args.clients)]
    options += ["--rounds", str(args.rounds), "--max_steps", str(args.max_steps), "--seed", str(args.seed)]
    options += ["--device", args.device, "--clip", str(args.clip)]
    with GpuSampler() as sampler:
        done = subprocess.run([sys.executable, __file__, *options], capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode != 0 or not lines:
        tail = [line for line in done.stderr.splitlines() if line.strip()][-1:] or ["no output"]
        return {"config": config, "error": f"exit {done.returncode}: {tail[0][:300]}"}
    return {**json.loads(lines[-1][len(MARK) :]), **sampler.summary()}


def main() -> None:
    """Run every configuration of every workload in children; print the table and the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument(
        "--configs",
        nargs="+",
        default=["plain", "seq", "proc4", "proc8"],
        help="plain, seq and procN (N worker processes sharing the device)",
    )
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds after one warm-up round")
    parser.add_argument("--max_steps", type=int, default=-1, help="local steps per client (-1: one epoch)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clip", type=float, default=10.0, help="gradient-norm clipping of every configuration")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--json", type=Path, default=None, help="also write the measurements here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child_workload", choices=list(WORKLOADS), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    bad = [c for c in args.configs if c not in ("plain", "seq") and not (c.startswith("proc") and c[4:].isdigit())]
    if bad:
        raise SystemExit(f"gpu_round: unknown configuration(s) {bad}; use plain, seq or procN (e.g. proc4)")
    if args.child is not None:
        args.workload = args.child_workload
        report(run_configuration(args.child, args))
        return
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("gpu_round: no CUDA GPU on this machine; run it where there is one, or pass --device cpu")
    results: dict[str, dict[str, Any]] = {}
    for workload in args.workloads:
        print(
            f"{workload}: {WORKLOADS[workload][0]}, {args.clients} clients, FedProto, batch 10, one local epoch, "
            f"{args.rounds} timed rounds after a warm-up, {os.cpu_count()} CPUs, device {args.device}",
            flush=True,
        )
        print("| configuration | round s (median) | rounds / hour | x plain | GPU util % | GPU memory GB | acc_local |")
        print("|---|---|---|---|---|---|---|", flush=True)
        rows: dict[str, dict[str, Any]] = results.setdefault(workload, {})
        for config in sorted(args.configs, key=lambda name: name != "plain"):  # the reference first
            row = rows[config] = spawn(workload, config, args)
            print(table_row(config, row, rows.get("plain", {}).get("round_s")), flush=True)
            if args.json:  # after every configuration: a run cut off at its limit keeps what it measured
                save_json(args, results)


def table_row(config: str, row: dict[str, Any], plain: list[float] | None) -> str:
    """One configuration's line of the table; adds its median, rounds per hour and ratio to ``row``."""
    if "error" in row:
        return f"| {config} | failed: {row['error']} |"
    median = statistics.median(row["round_s"])
    row["round_s_median"] = round(median, 3)
    row["rounds_per_hour"] = round(3600 / median, 1)
    if plain:
        row["speedup_vs_plain"] = round(statistics.median(plain) / median, 3)
    return (
        f"| {config} | {median:.2f} | {3600 / median:.0f} | {row.get('speedup_vs_plain', float('nan')):.2f} "
        f"| {row['gpu_util_mean_pct']} | {row['gpu_memory_peak_gb']} | {row['acc_local']:.2f} |"
    )


def save_json(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> None:
    """Write the measurements so far to ``--json`` atomically."""
    args.json.parent.mkdir(parents=True, exist_ok=True)
    temporary = args.json.with_suffix(".tmp")
    arguments = {k: str(v) for k, v in vars(args).items()}
    temporary.write_text(json.dumps({"args": arguments, "results": results}, indent=1) + "\n")
    temporary.replace(args.json)


if __name__ == "__main__":
    main()
