"""HtFLlib's HtFE-img-2 round: sequential with 1 and 2 threads vs Ray with 2 workers x 1 thread.

The workload is the one HtFLlib was timed on (issue 14): FedProto (lambda 10) with the HtFE-img-2
family (HtFLlib's FedAvgCNN and ResNet-18, alternating over the clients) and 512-d features
(HtFLlib's ``-fd 512``: ``AdaptiveAvgPool1d`` neck), 20 clients, all 5,000 embedded MNIST digits
(``mnist_all``) at 3x32x32, train and test pooled and split by Dirichlet(0.1) with at least 40
samples per client (HtFLlib's ``least_samples`` for batch 10 and a 75/25 split), each client's
share split 75/25 into local train and test, batch 10, SGD lr 0.01 without momentum, one local
epoch, all clients every round, and every client evaluated on its own test split every round as
HtFLlib does. fedhet's label-skew protocol also scores a global set; it is cut to 20 images
(``global_test_size``) and the global validation set to none, so evaluation costs what HtFLlib's does.

Each configuration runs in a child process of its own (its own peak RSS), one after the other in
the same invocation: round 0 is a warm-up (modules built, Ray's actors warmed up), then
``--rounds`` timed rounds. Reported per configuration: median round time, rounds per hour, the
share of the round spent outside client compute (1 - (seconds inside the client runtime's fit and
evaluation, summed over clients, divided by the workers) / round time: what the loop, transfers
and waiting add), peak RSS (driver, plus every Ray worker's), the PSS of the driver and every
process below it (Ray's workers, raylet and object store; shared pages counted once; the largest
of the snapshots taken at the end of each round, when every state is held), start-up time. The
memory line compares Ray with the sequential executor both ways. The 1-thread
configurations must end with identical client weights (per-client seeding); the script checks it.
The last line is the headline, e.g. ``ray (2 workers) / sequential (1 thread) round time ratio 0.55``.

Run on an otherwise idle machine (about 6 minutes on 2 cores; ``uptime`` first)::

    python benchmarks/htfe2_round.py [--rounds 3] [--configs seq1 seq2 ray] [--memory_format channels_last]

Side by side with HtFLlib itself (``--htfllib``: a checkout of github.com/TsingZ0/HtFLlib, never
downloaded here): the configurations ``htfllib1`` and ``htfllib2`` run HtFLlib's own ``main.py``
(FedProto, ``-m HtFE-img-2 -fd 512 -lam 10 -lbs 10 -lr 0.01``) at 1 and 2 threads on the very
client splits fedhet trains on, written in HtFLlib's layout (``dataset/NAME/{train,test}/ID.npz``,
pixels normalised as fedhet's loader does), timed by HtFLlib's own per-round print; they run
interleaved with fedhet's (``seq1 htfllib1 seq2 htfllib2 ray``), so a drift of the machine's speed
touches both sides alike, and the table adds fedhet/HtFLlib rounds-per-hour ratios. HtFLlib imports
h5py, scikit-learn and calmsize, which fedhet does not need; give a folder holding them with
``--htfllib_deps`` (``pip install --target DIR h5py scikit-learn calmsize``)::

    python benchmarks/htfe2_round.py --htfllib ../HtFLlib --htfllib_deps DIR --json docs/results/htfe2_side_by_side.json

What differs between the two sides, by design of each library: HtFLlib's FedProto takes its
prototypes from the features its training steps computed, while fedhet's default runs an
eval-mode pass over the training data after training (``--class_means_from training_steps`` gives
fedhet HtFLlib's way, and so the same work); HtFLlib's round 0 evaluates nothing (no global
prototypes yet), its train loader keeps the data order and drops every last partial batch, it
does not clip gradients, and it writes every client model to disk and reads it back each round;
fedhet shuffles, drops only a last batch of one image, clips at ``--clip`` and keeps states in
memory. Round 0 is the warm-up on both sides. HtFLlib's PSS is taken once, after its last round.

A quick end-to-end check (seconds per configuration, numbers meaningless)::

    python benchmarks/htfe2_round.py --clients 4 --rounds 1 --max_steps 2
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any

from _measure import (
    family_architectures,
    htfllib_scenario,
    load,
    peak_rss_gb,
    ray_worker_pids,
    report,
    run_child,
    tree_pss_gb,
)

COMPUTE_KEY = "bench/compute_s"
LABELS = {"seq1": "sequential (1 thread)", "seq2": "sequential (2 threads)", "ray": "ray (2 workers)"}
HTFLLIB_LABELS = {"htfllib1": "HtFLlib (1 thread)", "htfllib2": "HtFLlib (2 threads)"}
SIDE_BY_SIDE = ["seq1", "htfllib1", "seq2", "htfllib2", "ray"]  # interleaved: drift touches both sides
THREADS = {"seq2": 2, "htfllib2": 2}  # intra-op threads of each configuration's process (default 1)


# ------------------------------------------------------------------------------ timing the client runtime
def instrument(runtime: Any) -> None:
    """Time every client fit and evaluation inside ``runtime`` (the driver's, or a worker's).

    The seconds travel back with the results (a metrics key of each fit; an extra entry after
    each client's evaluation counts) and :func:`collect` strips them again on the driver.
    """
    import torch

    fit, evaluate = runtime.fit_client, runtime.evaluate_client

    def timed_fit(task: Any) -> Any:
        started = time.perf_counter()
        result = fit(task)
        return dataclasses.replace(result, metrics={**result.metrics, COMPUTE_KEY: time.perf_counter() - started})

    def timed_evaluate(task: Any, apply_download: bool = True) -> Any:
        started = time.perf_counter()
        counts = evaluate(task, apply_download)
        seconds = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        return [*counts, (seconds, torch.zeros(1, dtype=torch.float64))]

    runtime.fit_client, runtime.evaluate_client = timed_fit, timed_evaluate


def collect(executor: Any, seconds: list[float]) -> None:
    """Strip the timings :func:`instrument` added from the executor's results; add them to ``seconds[0]``."""
    fit_clients, evaluate = executor.fit_clients, executor.evaluate

    def fit_and_collect(tasks: Any, on_result: Any = None) -> Any:
        results = fit_clients(tasks, on_result)
        seconds[0] += sum(result.metrics.pop(COMPUTE_KEY) for result in results)
        return results

    def evaluate_and_collect(tasks: Any, apply_download: bool = True) -> Any:
        counts = evaluate(tasks, apply_download)
        seconds[0] += sum(float(client[-1][0]) for client in counts)
        return [client[:-1] for client in counts]

    executor.fit_clients, executor.evaluate = fit_and_collect, evaluate_and_collect


def timed_recipe(recipe: Any) -> Any:
    """The run's recipe, rebuilding worker runtimes with :func:`instrument` applied."""
    from fedhet.federation.runtime import RuntimeRecipe

    @dataclasses.dataclass(frozen=True)
    class TimedRecipe(RuntimeRecipe):
        def build(self) -> Any:
            runtime = super().build()
            instrument(runtime)
            return runtime

    return TimedRecipe(**{f.name: getattr(recipe, f.name) for f in dataclasses.fields(RuntimeRecipe)})


# ------------------------------------------------------------------------------ one configuration
def build_loop(name: str, args: argparse.Namespace) -> Any:
    """The HtFE-img-2 FedProto loop on the executor ``name`` stands for."""
    from fedhet.algorithms import FedProto
    from fedhet.federation import FederationLoop, FederationSettings, RuntimeRecipe, SequentialExecutor
    from fedhet.federation.trainer import TrainerTemplate

    scenario = htfllib_scenario(args.clients, args.seed)
    architectures = family_architectures("htfe_img_2", args.clients)
    algorithm = FedProto(lam=10.0, lr=0.01, momentum=0.0, class_means_from=args.class_means_from)
    # Clipping at norm 10 in every configuration: FedProto's lambda 10 diverged in round 2 at two
    # intra-op threads (different float summation order); a timing run must not stop on it.
    trainer = TrainerTemplate(
        max_epochs=1,
        max_steps=args.max_steps,
        accelerator="cpu",
        gradient_clip_val=args.clip,
        memory_format=args.memory_format,
    )
    recipe = RuntimeRecipe(
        architectures=tuple(architectures),
        seed=args.seed,
        rounds=args.rounds + 1,
        feature_dim=512,
        algorithm=algorithm,
        scenario=scenario,
        trainer=trainer,
    )
    if name == "ray":
        from fedhet.federation import RayExecutor

        executor: Any = RayExecutor(workers=2, cpus_per_worker=1.0, threads_per_worker=1)
    else:
        executor = SequentialExecutor()
    return FederationLoop(
        algorithm,
        scenario,
        architectures,
        trainer,
        rounds=args.rounds + 1,
        seed=args.seed,
        settings=FederationSettings(executor=executor),
        feature_dim=512,
        recipe=timed_recipe(recipe),
    )


def weights_digest(loop: Any) -> str:
    """A digest of every client's kept weights (equal digests: the same numbers)."""
    import torch

    digest = hashlib.blake2b(digest_size=12)
    for client_id in range(loop.scenario.num_clients):
        state = loop.store.get(client_id)
        for key, tensor in sorted(state["module"].items()):
            digest.update(key.encode())
            digest.update(tensor.detach().contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def run_configuration(name: str, args: argparse.Namespace) -> dict:
    """Build and run one configuration in this process; return its measurements."""
    import torch

    from fedhet.federation.trainer import silence_lightning

    torch.set_num_threads(THREADS.get(name, 1))
    silence_lightning()
    started = time.perf_counter()
    loop = build_loop(name, args)
    workers = 2 if name == "ray" else 1
    if name != "ray":
        instrument(loop.runtime)  # the sequential executor runs clients in the driver's runtime
    seconds = [0.0]
    collect(loop.executor, seconds)
    startup_s = time.perf_counter() - started
    rounds, computes, fits, evals, pss = [], [], [], [], []
    try:
        for round_idx in range(args.rounds + 1):
            seconds[0] = 0.0
            round_started = time.perf_counter()
            record = loop.run_round(round_idx)
            elapsed = time.perf_counter() - round_started
            loop.history.append(record)
            loop.next_round = round_idx + 1
            pss.append(tree_pss_gb())  # every state of the round held: the driver's store, the workers' own
            if round_idx > 0:
                rounds.append(elapsed)
                computes.append(seconds[0])
                fits.append(record["time/fit_s"])
                evals.append(record["time/eval_s"])
        worker_rss = [peak_rss_gb(pid) for pid in ray_worker_pids()] if name == "ray" else []
        traffic = {key: getattr(loop.executor, key, None) for key in ("states_sent", "states_kept")}
    finally:
        loop.executor.shutdown()
    steps = sum(len(loop.scenario.train_loader(c, 0)) for c in range(loop.scenario.num_clients))
    return {
        "config": name,
        "workers": workers,
        "startup_s": round(startup_s, 2),
        "round_s": rounds,
        "compute_s": computes,
        "fit_s": fits,
        "eval_s": evals,
        "steps_per_round": steps if args.max_steps < 0 else args.max_steps * loop.scenario.num_clients,
        "driver_peak_rss_gb": round(peak_rss_gb(), 3),
        "worker_peak_rss_gb": [round(x, 3) for x in worker_rss],
        "tree_pss_gb": round(max(pss), 3),
        "acc_local": loop.history[-1].get("acc_local"),
        "weights": weights_digest(loop),
        **traffic,
    }


# ------------------------------------------------------------------------------ HtFLlib itself, same splits
def write_htfllib_dataset(scenario: Any, folder: Path) -> int:
    """Every client's local train and test split in HtFLlib's layout; HtFLlib's local steps per epoch.

    HtFLlib reads ``folder/{train,test}/ID.npz``, each holding ``data = {"x": float32 NCHW, "y": int64}``
    (``utils/data_utils.read_data``). Pixels are normalised with the scenario's mean and std, as fedhet's
    loader serves them.
    """
    import numpy as np
    import torch

    mean = torch.tensor(scenario.mean).view(1, -1, 1, 1)
    std = torch.tensor(scenario.std).view(1, -1, 1, 1)
    steps = 0
    for client_id in range(scenario.num_clients):
        data = scenario.client_data(client_id)
        for split, part in (("train", data.train), ("test", data.test)):
            (folder / split).mkdir(parents=True, exist_ok=True)
            pixels = ((part.x.float() / 255.0 - mean) / std).numpy()
            with open(folder / split / f"{client_id}.npz", "wb") as file:
                np.savez(file, data={"x": pixels, "y": part.y.numpy()})
        steps += len(data.train) // scenario.batch_size  # HtFLlib's train loader drops the last partial batch
    return steps


def htfllib_main(root: str) -> Path:
    """HtFLlib's ``main.py`` in a checkout (its root or its ``system`` folder), or a one-line exit."""
    for folder in (Path(root), Path(root) / "system"):
        if (folder / "main.py").is_file() and (folder / "flcore").is_dir():
            return folder.resolve() / "main.py"
    raise SystemExit(f"--htfllib {root}: no HtFLlib checkout there (system/main.py and system/flcore missing)")


def stub_unimportable_servers(system: Path) -> list[str]:
    """Stand-ins for HtFLlib server modules whose own dependencies are not installed.

    ``main.py`` imports every algorithm's server at its top (FedKTL's StyleGAN and Stable Diffusion
    servers, FedL2G's ``higher`` ...); FedProto needs none of them. Returns the stubbed module names.
    """
    import importlib
    import sys
    import types

    stubbed = []
    for path in sorted((system / "flcore" / "servers").glob("server*.py")):
        name = f"flcore.servers.{path.stem}"
        try:
            importlib.import_module(name)
        except ImportError:
            stub = types.ModuleType(name)
            stub.__getattr__ = lambda attribute: None  # type: ignore[method-assign]  # ``from X import Y`` -> None
            sys.modules[name] = stub
            stubbed.append(path.stem)
    return stubbed


def run_htfllib(name: str, args: argparse.Namespace) -> dict:
    """HtFLlib's own FedProto on fedhet's client splits, in this process; its per-round times."""
    import contextlib
    import io
    import runpy
    import sys
    import tempfile

    import torch

    main_py = htfllib_main(args.htfllib)
    torch.set_num_threads(THREADS.get(name, 1))
    scenario = htfllib_scenario(args.clients, args.seed)
    with tempfile.TemporaryDirectory(prefix="htfllib-") as tmp:
        steps = write_htfllib_dataset(scenario, Path(tmp) / "dataset" / "fedhet_htfe2")
        work = Path(tmp) / "system"  # HtFLlib reads ../dataset and writes ../results, temp/ from here
        work.mkdir()
        os.chdir(work)
        sys.path[:0] = [str(main_py.parent), *args.htfllib_deps]
        stubbed = stub_unimportable_servers(main_py.parent)
        # HtFLlib saves whole pickled models each round and reads them back with torch.load's pre-2.6
        # default; these are its own files in this temporary folder, never anything fedhet loads
        os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
        sys.argv = [str(main_py), "-data", "fedhet_htfe2", "-m", "HtFE-img-2", "-algo", "FedProto"]
        sys.argv += ["-gr", str(args.rounds), "-nc", str(args.clients), "-ncl", str(scenario.num_classes)]
        sys.argv += ["-lbs", "10", "-lr", "0.01", "-fd", "512", "-lam", "10", "-ls", "1", "-dev", "cpu"]
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            runpy.run_path(str(main_py), run_name="__main__")
        pss = tree_pss_gb()
    # FedProto.train prints "-" * 50 and the round's seconds after each round (round 0 first)
    round_line = re.compile(r"-{50} ([0-9.e+-]+)")
    rounds = [float(match[1]) for line in printed.getvalue().splitlines() if (match := round_line.fullmatch(line))]
    if len(rounds) != args.rounds + 1:
        raise SystemExit(f"{name}: HtFLlib printed {len(rounds)} round times, not {args.rounds + 1}")
    accuracies = [line.split()[-1] for line in printed.getvalue().splitlines() if "Averaged Test Accuracy" in line]
    return {
        "config": name,
        "workers": 1,
        "round_s": rounds[1:],
        "steps_per_round": steps,
        "driver_peak_rss_gb": round(peak_rss_gb(), 3),
        "worker_peak_rss_gb": [],
        "tree_pss_gb": round(pss, 3),
        "acc_local": float(accuracies[-1]) if accuracies else None,
        "stubbed_servers": stubbed,
    }


def summed_rss_gb(result: dict) -> float:
    """The driver's peak RSS plus every Ray worker's (pages they share are counted once per process)."""
    return result["driver_peak_rss_gb"] + sum(result["worker_peak_rss_gb"])


def spawn(name: str, args: argparse.Namespace) -> dict:
    """Run one configuration in a fresh child process and return what it measured."""
    options = ["--child", name, "--clients", str(args.clients), "--rounds", str(args.rounds)]
    options += ["--max_steps", str(args.max_steps), "--seed", str(args.seed), "--clip", str(args.clip)]
    options += ["--memory_format", args.memory_format, "--class_means_from", args.class_means_from]
    if name in HTFLLIB_LABELS:
        options += ["--htfllib", args.htfllib, "--htfllib_deps", *args.htfllib_deps]
    return run_child(__file__, options, THREADS.get(name, 1), name)


def main() -> None:
    """Run every configuration (children), print the table, the weights check and the headline."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up round")
    parser.add_argument("--max_steps", type=int, default=-1, help="local steps per client (-1: one epoch)")
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=[*LABELS, *HTFLLIB_LABELS],
        default=None,
        help=f"default: {' '.join(LABELS)}; with --htfllib: {' '.join(SIDE_BY_SIDE)}",
    )
    parser.add_argument("--htfllib", default=None, help="a checkout of HtFLlib, to time its FedProto side by side")
    parser.add_argument(
        "--htfllib_deps", nargs="*", default=[], help="folders holding HtFLlib's h5py, scikit-learn, calmsize"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clip", type=float, default=10.0, help="gradient-norm clipping of every configuration")
    parser.add_argument("--json", default=None, help="also write the measurements here")
    parser.add_argument(
        "--memory_format",
        choices=["contiguous", "channels_last"],
        default="contiguous",
        help="trainer.memory_format of every configuration (channels_last was 7-12 %% slower here on 2026-11-28)",
    )
    parser.add_argument(
        "--class_means_from",
        choices=["eval_pass", "training_steps"],
        default="eval_pass",
        help="FedProto's prototypes: fedhet's default eval pass after training, or the training steps' own "
        "features as HtFLlib's FedProto takes them (no extra pass: the same work as HtFLlib's round)",
    )
    parser.add_argument("--child", choices=[*LABELS, *HTFLLIB_LABELS], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        run = run_htfllib if args.child in HTFLLIB_LABELS else run_configuration
        report(run(args.child, args))
        return
    if args.configs is None:
        args.configs = SIDE_BY_SIDE if args.htfllib else list(LABELS)
    if any(name in HTFLLIB_LABELS for name in args.configs):
        if not args.htfllib:
            parser.error("the htfllib configurations need --htfllib (a checkout of HtFLlib)")
        htfllib_main(args.htfllib)  # a missing checkout stops here, before any run
    labels = {**LABELS, **HTFLLIB_LABELS}

    print(f"{os.cpu_count()} CPUs; {load()}")
    print(
        f"HtFE-img-2 (fedavg_cnn, resnet18), FedProto lambda 10, 512-d features, {args.clients} clients, "
        f"mnist_all 3x32x32 Dir(0.1) >= 40 per client, batch 10, SGD lr 0.01 (clipped at {args.clip:g}), "
        f"{'one local epoch' if args.max_steps < 0 else f'{args.max_steps} local steps'}, "
        f"{args.rounds} timed rounds after a warm-up, {args.memory_format}, prototypes from {args.class_means_from}"
    )
    results = {}
    for name in args.configs:
        results[name] = spawn(name, args)
        print(f"  {labels[name]:24s} rounds {' '.join(f'{t:.2f}' for t in results[name]['round_s'])} s; {load()}")
    print()
    print(
        "| configuration | round s (median) | rounds / hour | outside client compute | peak RSS GB "
        "| PSS GB (all processes, largest at a round's end) | start-up s |"
    )
    print("|---|---|---|---|---|---|---|")
    medians = {}
    for name, result in results.items():
        median = statistics.median(result["round_s"])
        medians[name] = median
        outside = "n/a"  # HtFLlib's rounds are not split into client compute and the rest
        if "compute_s" in result:
            share = statistics.median(
                1.0 - (compute / result["workers"]) / total
                for compute, total in zip(result["compute_s"], result["round_s"], strict=True)
            )
            outside = f"{100 * share:.1f} %"
        rss = summed_rss_gb(result)
        detail = f" (driver {result['driver_peak_rss_gb']:.2f} + workers)" if result["worker_peak_rss_gb"] else ""
        startup = f"{result['startup_s']:.1f}" if "startup_s" in result else "n/a"
        print(
            f"| {labels[name]} | {median:.2f} | {3600 / median:.0f} | {outside} | {rss:.2f}{detail} "
            f"| {result['tree_pss_gb']:.2f} | {startup} |"
        )
    steps = next((result["steps_per_round"] for name, result in results.items() if name in LABELS), 0)
    if "ray" in results and results["ray"].get("states_kept") is not None:
        ray_result = results["ray"]
        print(
            f"\nray: {ray_result['states_kept']} client tasks used the state kept on their worker, "
            f"{ray_result['states_sent']} carried it (all {args.rounds + 1} rounds, fits and evaluations)"
        )
    if steps:
        print(f"\n{steps} local steps per round; {load()}")
    single = [name for name in results if name in ("seq1", "ray")]
    if len(single) == 2:
        same = results["seq1"]["weights"] == results["ray"]["weights"]
        print(f"client weights after {args.rounds + 1} rounds identical, sequential (1 thread) and ray: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1) + "\n")
    sequential = [name for name in ("seq1", "seq2") if name in results]
    if "ray" in results and sequential:
        base = results[sequential[0]]
        print(
            f"ray / {LABELS[sequential[0]]} memory: peak RSS summed over processes "
            f"{summed_rss_gb(results['ray']) / summed_rss_gb(base):.2f}, "
            f"PSS of all processes {results['ray']['tree_pss_gb'] / base['tree_pss_gb']:.2f} (goal: at most 2)"
        )
    htfllib = {name: medians[name] for name in HTFLLIB_LABELS if name in medians}
    if htfllib:
        theirs = next(results[name]["steps_per_round"] for name in htfllib)
        print(f"HtFLlib: {theirs} local steps per round (every last partial batch dropped)")
        for ours, reference in (("seq1", "htfllib1"), ("seq2", "htfllib2")):
            if ours in medians and reference in medians:
                per_step = (medians[reference] / theirs) / (medians[ours] / steps)
                print(
                    f"fedhet {LABELS[ours]} / {HTFLLIB_LABELS[reference]} rounds per hour "
                    f"{medians[reference] / medians[ours]:.2f} (goal: at least 1); per local step {per_step:.2f}"
                )
        best = min(htfllib, key=htfllib.get)
        for ours in ("seq2", "ray"):
            if ours in medians:
                print(
                    f"fedhet {LABELS[ours]} / HtFLlib's best ({HTFLLIB_LABELS[best]}) rounds per hour "
                    f"{htfllib[best] / medians[ours]:.2f}"
                )
    if "ray" in medians and "seq1" in medians:
        print(f"ray (2 workers) / sequential (1 thread) round time ratio {medians['ray'] / medians['seq1']:.2f}")


if __name__ == "__main__":
    main()
