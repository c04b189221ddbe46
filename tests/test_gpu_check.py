"""The GPU check script (``benchmarks/gpu_check.py``) works on the CPU as it must on a lent GPU.

A GPU machine is lent for minutes, so the script has to run right the first time: it must find a
shipped config for every registered method, pass the contract tests' short budgets as valid
command-line values, and, end to end on the CPU, judge runs the way the GPU run will.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedhet.algorithms import ALGORITHMS
from fedhet.federation.trainer import TrainerTemplate

ROOT = Path(__file__).resolve().parents[1]


def _load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_check", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_registered_method_has_a_cpu_sized_config_the_check_runs():
    """A method added without a shipped CPU-sized config would be a failing line on the GPU; here it fails first."""
    gpu_check = _load_gpu_check()
    found = gpu_check.method_configs()
    assert set(found) == set(ALGORITHMS)
    missing = [name for name, (config, _) in found.items() if not config]
    assert not missing, f"no config in {gpu_check.METHOD_FOLDERS} for {missing}"
    # a wrapped method's knobs sit under its base (FedPer inside PaperProtocol)
    assert found["fedper"] == ("configs/experiments/mnist_mdcg/fedper.yaml", "method.init_args.base.init_args")
    assert found["fedavg"] == ("configs/experiments/digits/fedavg.yaml", "method.init_args")


def test_the_short_budgets_parse_as_each_methods_knobs(tmp_path):
    """Every method check's command line parses (``--print_config``), short budgets included."""
    gpu_check = _load_gpu_check()
    checks = {c.name: c for c in gpu_check.method_checks(tmp_path, "cpu", rounds=2)}
    for name in ("fedmdcg", "fedftg", "fedktl", "fedvtc"):
        argv = [*checks[f"method/{name}"].argv[:-2], "--print_config"]  # without --run_dir
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, (name, done.stderr[-500:])
        if name == "fedmdcg":
            assert "server_steps: 2" in done.stdout and "- 16" in done.stdout


def test_deterministic_warn_reaches_the_trainer():
    """``trainer.deterministic: warn`` (deterministic kernels where they exist) is passed to Lightning as is."""
    assert TrainerTemplate(accelerator="cpu", deterministic="warn").trainer_kwargs()["deterministic"] == "warn"
    assert TrainerTemplate(accelerator="cpu", deterministic="warn").build().fit_loop is not None


@pytest.mark.slow
def test_the_check_script_end_to_end_on_the_cpu(tmp_path):
    """Method, executor, resume and ``fedhet test`` checks pass on the CPU and land in one JSON."""
    out = tmp_path / "check.json"
    only = ["method/fedavg", "executor/sequential", "resume", "test"]
    argv = [sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--root", str(tmp_path / "runs"),
            "--json", str(out), "--parallel", "1", "--no-throughput", "--only", *only]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["checks"]) == set(only) and report["failed"] == [], report
