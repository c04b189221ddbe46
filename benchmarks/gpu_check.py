"""The GPU path in one command: every method, every executor, resume, bf16, channels-last, ``fedhet test``.

Everything a GPU machine is lent for, prepared on the CPU so that one call of a few minutes does
it all and writes one JSON (``--json``, rewritten atomically after every check, so a run cut off
at its limit still leaves what it found):

- ``method/<name>``: every registered method, two rounds of one local epoch on its shipped
  CPU-sized config (``configs/experiments/{digits,mnist_vtc,mnist_ftg,mnist_mdcg,digits_dir}``)
  through ``python -m fedhet fit --trainer.accelerator=gpu``, with the server budgets the contract
  tests shrink (``tests/algorithms/helpers.FAST``) and FedKTL's untrained generator (the
  pretrained one takes minutes to build on first use). Passes when the run ends with finite metrics.
- ``executor/sequential``, ``executor/process`` (two worker processes on the GPU),
  ``executor/ray`` (two actors with half a GPU each): the main job (FedProto on the embedded
  Digits), two rounds, deterministic kernels (``--trainer.deterministic=warn``); the process and
  Ray runs must end with the sequential run's numbers.
- ``resume``: the same run killed (SIGKILL) after its first round and continued with ``--resume``
  must end with the uninterrupted (sequential) run's numbers.
- ``bf16`` (``--trainer.precision=bf16-mixed``) and ``channels_last``
  (``--trainer.memory_format=channels_last``): the main job finishes with finite metrics; the
  accuracy differences from the fp32 contiguous run are recorded.
- ``test``: ``fedhet test RUN_DIR`` on the sequential GPU run exits 0 and reproduces its final metrics.
- ``throughput``: ``benchmarks/gpu_round.py`` (fedhet's sequential executor and clients sharing
  the GPU against a plain PyTorch loop), its JSON merged in.

A failing check is one line in the output and the JSON naming the method or executor and the
error's last line; the other checks go on. Independent runs go ``--parallel`` at a time (several
processes share the GPU, as users' sweeps do); the throughput benchmark runs last, alone.

Run on a GPU machine (about 5 minutes on an H100 or H200)::

    python benchmarks/gpu_check.py --json docs/results/gpu_check.json

``--device cpu --only method/fedavg executor/sequential resume test --no-throughput`` checks the
script itself on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MAIN_JOB = "configs/experiments/digits/fedproto.yaml"
#: the CPU-sized config folders, searched in this order for a method's first shipped config
METHOD_FOLDERS = ("digits", "mnist_vtc", "mnist_ftg", "mnist_mdcg", "digits_dir")
#: the blocks of ``summary.json`` that two runs doing the same work must agree on
SAME_NUMBER_BLOCKS = ("final", "best", "last3", "comm", "matrix")


@dataclass
class Check:
    """One independent check: a command, then a verdict on what it left (``None``: passed)."""

    name: str
    argv: list[str]
    verify: Callable[[Path], str | None] | None = None
    run_dir: Path | None = None
    result: dict[str, Any] = field(default_factory=dict)


def python_fedhet(*args: str) -> list[str]:
    """The command line of ``python -m fedhet <args>`` with this interpreter."""
    return [sys.executable, "-m", "fedhet", *args]


def child_env() -> dict[str, str]:
    """The environment of every run: deterministic cuBLAS (for ``use_deterministic_algorithms`` on CUDA), no W&B."""
    # deterministic cuBLAS (needed by torch.use_deterministic_algorithms on CUDA); no W&B, no network
    return {**os.environ, "WANDB_MODE": "disabled", "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONUNBUFFERED": "1"}


def last_error_line(stderr: str) -> str:
    """The line of a failed run's stderr that names its error (its last line if none does)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["no output"])[-1][:400]


def load_summary(run_dir: Path) -> dict[str, Any]:
    """A run directory's ``summary.json``."""
    return json.loads((run_dir / "summary.json").read_text())


def finite_final(run_dir: Path) -> str | None:
    """A verdict: the run wrote its summary and every final metric is finite."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return "no summary.json"
    final = load_summary(run_dir)["final"]
    bad = [k for k, v in final.items() if isinstance(v, float) and not math.isfinite(v)]
    return f"non-finite final metrics {bad}" if bad else None


def same_numbers(reference: Path) -> Callable[[Path], str | None]:
    """A verdict: the run ends with exactly ``reference``'s summary blocks (and finite metrics)."""

    def verify(run_dir: Path) -> str | None:
        problem = finite_final(run_dir)
        if problem or not (reference / "summary.json").is_file():
            return problem or f"reference run {reference.name} has no summary.json"
        ours, theirs = load_summary(run_dir), load_summary(reference)
        differ = [block for block in SAME_NUMBER_BLOCKS if ours.get(block) != theirs.get(block)]
        if differ:
            gap = {
                k: round(ours["final"][k] - theirs["final"][k], 4)
                for k in theirs["final"]
                if isinstance(theirs["final"][k], float) and k in ours["final"]
            }
            return f"numbers differ from {reference.name} in {differ}; final differences {gap}"
        return None

    return verify


# ------------------------------------------------------------------------------ the checks
def method_configs() -> dict[str, tuple[str, str]]:
    """Each registered method's first CPU-sized shipped config and the dotted prefix of its own knobs."""
    import yaml

    from fedhet.algorithms import ALGORITHMS

    by_class = {cls.__name__: name for name, cls in ALGORITHMS.items()}
    found: dict[str, tuple[str, str]] = {}
    for folder in METHOD_FOLDERS:
        for path in sorted((REPO / "configs" / "experiments" / folder).glob("*.yaml")):
            node, prefix = yaml.safe_load(path.read_text()).get("method", {}), "method"
            while isinstance(node, dict):  # a wrapper (PaperProtocol) names the method as its base
                name = by_class.get(str(node.get("class_path", "")).rsplit(".", 1)[-1])
                if name is not None and name not in found and name != "paper_protocol":
                    found[name] = (str(path.relative_to(REPO)), f"{prefix}.init_args")
                    break
                node, prefix = (node.get("init_args") or {}).get("base"), f"{prefix}.init_args.base"
    missing = sorted(set(ALGORITHMS) - set(found))
    for name in missing:
        found[name] = ("", "")
    return found


def cli_value(value: Any) -> str:
    """A knob value as the command line takes it (sequences as JSON lists)."""
    return json.dumps(list(value)) if isinstance(value, (tuple, list)) else str(value)


def method_checks(root: Path, accelerator: str, rounds: int) -> list[Check]:
    """One ``fedhet fit`` check per registered method, on its first CPU-sized shipped config."""
    from tests.algorithms.helpers import FAST

    checks = []
    for name, (config, prefix) in sorted(method_configs().items()):
        run_dir = root / "method" / name
        if not config:
            checks.append(
                Check(
                    f"method/{name}",
                    [],
                    run_dir=run_dir,
                    result={"ok": False, "error": "no shipped CPU-sized config names this method"},
                )
            )
            continue
        budget = dict(FAST.get(name, {}))
        if name == "fedktl":
            budget["generator"] = "untrained"
        argv = python_fedhet(
            "fit",
            "--config",
            config,
            "--rounds",
            str(rounds),
            "--trainer.max_epochs=1",
            f"--trainer.accelerator={accelerator}",
            "--federation.executor=sequential",
            "--federation.eval_every=1",
            *(f"--{prefix}.{key}={cli_value(value)}" for key, value in budget.items()),
            "--run_dir",
            str(run_dir),
        )
        checks.append(Check(f"method/{name}", argv, finite_final, run_dir))
    return checks


def main_job(accelerator: str, run_dir: Path, *extra: str) -> list[str]:
    """The main job (FedProto on the embedded Digits) for two one-epoch rounds with deterministic kernels."""
    return python_fedhet(
        "fit",
        "--config",
        MAIN_JOB,
        "--rounds",
        "2",
        "--trainer.max_epochs=1",
        f"--trainer.accelerator={accelerator}",
        "--trainer.deterministic=warn",
        "--server_trainer.deterministic=warn",
        *extra,
        "--run_dir",
        str(run_dir),
    )


def executor_checks(root: Path, accelerator: str) -> tuple[Check, list[Check]]:
    """The sequential reference run, and the checks that compare with it or only need it to finish."""
    reference = root / "executor" / "sequential"
    sequential = Check(
        "executor/sequential",
        main_job(accelerator, reference, "--federation.executor=sequential"),
        finite_final,
        reference,
    )
    gpu_share = ["--federation.executor.init_args.gpus_per_worker=0.5"] if accelerator == "gpu" else []
    others = [
        Check(
            "executor/process",
            main_job(
                accelerator,
                root / "executor" / "process",
                "--federation.executor=process",
                "--federation.executor.init_args.workers=2",
            ),
            same_numbers(reference),
            root / "executor" / "process",
        ),
        Check(
            "executor/ray",
            main_job(
                accelerator,
                root / "executor" / "ray",
                "--federation.executor=ray",
                "--federation.executor.init_args.workers=2",
                *gpu_share,
            ),
            same_numbers(reference),
            root / "executor" / "ray",
        ),
        Check(
            "bf16",
            main_job(
                accelerator,
                root / "bf16",
                "--federation.executor=sequential",
                "--trainer.precision=bf16-mixed",
                "--server_trainer.precision=bf16-mixed",
            ),
            finite_final,
            root / "bf16",
        ),
        Check(
            "channels_last",
            main_job(
                accelerator,
                root / "channels_last",
                "--federation.executor=sequential",
                "--trainer.memory_format=channels_last",
            ),
            finite_final,
            root / "channels_last",
        ),
    ]
    return sequential, others


def run_check(check: Check, timeout_s: float) -> dict[str, Any]:
    """Run one check's command (at most ``timeout_s``) and judge what it left."""
    if check.result:  # decided before running (no config)
        return check.result
    started = time.perf_counter()
    try:
        done = subprocess.run(
            check.argv, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return {
            "ok": False,
            "seconds": round(time.perf_counter() - started, 1),
            "error": f"timed out after {timeout_s:.0f} s",
        }
    result: dict[str, Any] = {"seconds": round(time.perf_counter() - started, 1)}
    if done.returncode != 0:
        return {**result, "ok": False, "error": f"exit {done.returncode}: {last_error_line(done.stderr)}"}
    problem = check.verify(check.run_dir) if check.verify and check.run_dir else None
    result.update(ok=problem is None, **({"error": problem} if problem else {}))
    if check.run_dir and (check.run_dir / "summary.json").is_file():
        final = load_summary(check.run_dir)["final"]
        result["final"] = {k: round(v, 3) for k, v in final.items() if k.startswith("acc") and isinstance(v, float)}
    return result


def resume_check(root: Path, accelerator: str, reference: Path, timeout_s: float) -> dict[str, Any]:
    """Kill the main job after its first round (SIGKILL), ``--resume`` it, compare with ``reference``."""
    run_dir = root / "resume"
    started = time.perf_counter()
    process = subprocess.Popen(
        main_job(accelerator, run_dir, "--federation.executor=sequential"),
        cwd=REPO,
        env=child_env(),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    killed = False
    assert process.stderr is not None
    for line in process.stderr:  # a round's checkpoint is written before its progress line
        if "round   1/2" in line:
            process.send_signal(signal.SIGKILL)
            killed = True
            break
    process.wait(timeout=timeout_s)
    if not killed:
        return {"ok": False, "error": "the run ended before it could be killed after round 1"}
    if (run_dir / "summary.json").exists():
        return {"ok": False, "error": "a summary.json exists after the kill"}
    check = Check("resume", python_fedhet("fit", "--resume", str(run_dir)), same_numbers(reference), run_dir)
    result = run_check(check, timeout_s)
    return {**result, "seconds": round(time.perf_counter() - started, 1)}


def test_command_check(reference: Path, accelerator: str, timeout_s: float) -> dict[str, Any]:
    """``fedhet test RUN_DIR`` exits 0, and evaluating the saved state gives the run's final metrics."""
    if not (reference / "summary.json").is_file():
        return {"ok": False, "error": "the sequential run has no summary.json to test"}
    started = time.perf_counter()
    done = subprocess.run(
        python_fedhet("test", str(reference), f"--trainer.accelerator={accelerator}"),
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if done.returncode != 0:
        return {"ok": False, "error": f"fedhet test exit {done.returncode}: {last_error_line(done.stderr)}"}
    code = (
        "import json, sys; from fedhet.cli import evaluate_run; "
        f"print(json.dumps(evaluate_run(sys.argv[1], ['--trainer.accelerator={accelerator}'])['final']))"
    )
    evaluated = subprocess.run(
        [sys.executable, "-c", code, str(reference)],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if evaluated.returncode != 0:
        return {"ok": False, "error": f"evaluate_run exit {evaluated.returncode}: {last_error_line(evaluated.stderr)}"}
    final = json.loads(evaluated.stdout.strip().splitlines()[-1])
    trained = load_summary(reference)["final"]
    differ = {k: (final.get(k), v) for k, v in trained.items() if k.startswith("acc") and final.get(k) != v}
    seconds = round(time.perf_counter() - started, 1)
    return {"ok": not differ, "seconds": seconds, **({"error": f"re-evaluation differs: {differ}"} if differ else {})}


# ------------------------------------------------------------------------------ the run
class Report:
    """The JSON, rewritten atomically after every check; one line printed per check."""

    def __init__(self, path: Path | None, header: dict[str, Any]) -> None:
        self.path = path
        self.data: dict[str, Any] = {**header, "checks": {}}

    def add(self, name: str, result: dict[str, Any]) -> None:
        self.data["checks"][name] = result
        status = "ok  " if result.get("ok") else "FAIL"
        detail = result.get("error") or json.dumps(result.get("final", {}))
        print(f"{status} {name:28s} {result.get('seconds', 0):6.1f} s  {detail}", flush=True)
        self.write()

    def write(self) -> None:
        checks = self.data["checks"].values()
        self.data["passed"] = sum(1 for c in checks if c.get("ok"))
        self.data["failed"] = sorted(n for n, c in self.data["checks"].items() if not c.get("ok"))
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
        temporary.write_text(json.dumps(self.data, indent=1) + "\n")
        temporary.replace(self.path)


def device_header(accelerator: str) -> dict[str, Any]:
    """What the JSON says about the machine: accelerator, device name, torch, Ray."""
    import torch

    header: dict[str, Any] = {
        "accelerator": accelerator,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    if accelerator == "gpu":
        header["device"] = torch.cuda.get_device_name(0)
    try:
        import ray

        header["ray"] = ray.__version__
    except ImportError:
        header["ray"] = None
    return header


def main(argv: Sequence[str] | None = None) -> None:
    """Run every wanted check, then the throughput benchmark; print one line per check."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--root", type=Path, default=Path("/tmp/fedhet_gpu_check"), help="run directories")
    parser.add_argument("--parallel", type=int, default=6, help="independent runs at a time")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds one run may take")
    parser.add_argument("--only", nargs="+", default=None, help="run only these checks (e.g. method/fedavg resume)")
    parser.add_argument("--no-throughput", dest="throughput", action="store_false")
    parser.add_argument("--throughput-args", default="", help="extra arguments of benchmarks/gpu_round.py")
    parser.add_argument("--throughput-timeout", type=float, default=300.0, help="seconds the benchmark may take")
    args = parser.parse_args(argv)
    if args.device == "gpu":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("gpu_check: no CUDA GPU on this machine; run it where there is one, or pass --device cpu")
    if args.root.exists() and any(args.root.iterdir()):
        raise SystemExit(
            f"gpu_check: {args.root} is not empty; pass an empty --root (run directories are never reused)"
        )

    def wanted(name: str) -> bool:
        return args.only is None or name in args.only

    report = Report(args.json, device_header(args.device))
    # build the embedded data's cache once, before parallel runs would each build it
    warm = subprocess.run(
        [sys.executable, "-c", "from fedhet.data.embedded import load_embedded; load_embedded()"],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    if warm.returncode != 0:
        report.add("embedded_data", {"ok": False, "error": last_error_line(warm.stderr)})
    sequential, others = executor_checks(args.root, args.device)
    reference = sequential.run_dir
    assert reference is not None
    # the reference run first, beside the methods; the runs compared with it once it has finished
    independent = [c for c in [sequential, *method_checks(args.root, args.device, rounds=2)] if wanted(c.name)]
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        futures = [(check.name, pool.submit(run_check, check, args.timeout)) for check in independent]
        if wanted(sequential.name):
            futures[0][1].result()
        futures += [(check.name, pool.submit(run_check, check, args.timeout)) for check in others if wanted(check.name)]
        if wanted("resume"):
            futures.append(("resume", pool.submit(resume_check, args.root, args.device, reference, args.timeout)))
        if wanted("test"):
            futures.append(("test", pool.submit(test_command_check, reference, args.device, args.timeout)))
        for name, future in futures:
            report.add(name, future.result())
    if args.throughput and wanted("throughput"):
        out = args.root / "gpu_round.json"
        command = [
            sys.executable,
            str(REPO / "benchmarks" / "gpu_round.py"),
            "--json",
            str(out),
            "--device",
            "cuda" if args.device == "gpu" else "cpu",
            *args.throughput_args.split(),
        ]
        started = time.perf_counter()
        try:
            done = subprocess.run(
                command,
                cwd=REPO,
                env=child_env(),
                text=True,
                capture_output=True,
                check=False,
                timeout=args.throughput_timeout,
            )
        except subprocess.TimeoutExpired as expired:
            stdout = expired.stdout.decode() if isinstance(expired.stdout, bytes) else expired.stdout or ""
            done = subprocess.CompletedProcess(command, 124, stdout, f"timed out after {args.throughput_timeout:.0f} s")
        print(done.stdout, end="", flush=True)
        result: dict[str, Any] = {"seconds": round(time.perf_counter() - started, 1), "ok": done.returncode == 0}
        if out.is_file():
            result["results"] = json.loads(out.read_text())["results"]
            failed = [f"{w}/{c}" for w, rows in result["results"].items() for c, row in rows.items() if "error" in row]
            if failed:
                result.update(ok=False, error=f"configurations failed: {failed}")
        if done.returncode != 0:
            result["error"] = f"exit {done.returncode}: {last_error_line(done.stderr)}"
        report.add("throughput", result)
    print(f"{report.data['passed']} passed, {len(report.data['failed'])} failed: {report.data['failed']}")


if __name__ == "__main__":
    main()
