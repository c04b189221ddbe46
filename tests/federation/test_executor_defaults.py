"""Executor choice without Ray: the slow-default warning, short names, and a missing Ray in one line."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from fedhet.config import load_yaml, prepare_args
from fedhet.errors import ConfigError
from fedhet.federation import RayExecutor


def test_executor_short_names_map_to_class_paths():
    """--federation.executor ray|process|sequential and the same names in a config file become class paths."""
    assert prepare_args(["--federation.executor", "ray"]) == ["--federation.executor=fedhet.federation.RayExecutor"]
    assert prepare_args(["--federation.executor=Process", "--federation.executor.workers=3"]) == [
        "--federation.executor=fedhet.federation.ProcessExecutor",
        "--federation.executor.workers=3",
    ]
    config = load_yaml("federation: {executor: {class_path: sequential}}")
    assert config["federation"]["executor"]["class_path"] == "fedhet.federation.SequentialExecutor"


def test_importing_fedhet_never_imports_ray():
    """fedhet, its federation package and the command line import without importing Ray."""
    code = "import sys, fedhet, fedhet.federation, fedhet.config, fedhet.cli; assert 'ray' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_missing_ray_is_one_line(monkeypatch):
    """Asking for the Ray executor without Ray installed is one ConfigError saying what to install."""
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ConfigError, match=r"install fedhet\[ray\]") as error:
        RayExecutor(workers=2)
    assert "\n" not in str(error.value)


def test_workers_keep_threads_per_worker_over_the_configs_threads():
    """A worker rebuilt from the config's recipe runs ``threads_per_worker`` threads, whatever ``threads`` says.

    ``threads: 1`` is the driver's count; ``threads_per_worker: 2`` the workers' (docs/concepts.md). The
    rebuild used to re-apply ``threads`` after the executor had set the worker's count, so each worker ran
    one thread.
    """
    import torch

    from fedhet.config import build_objects_from_yaml, parse_args
    from fedhet.federation.executors import build_worker_runtime
    from fedhet.federation.runtime import RuntimeRecipe
    from tests.conftest import tiny_overrides

    config = Path(__file__).resolve().parents[2] / "configs/experiments/digits_dir/fedavg.yaml"
    executor = ["--federation.executor=process", "--federation.executor.threads_per_worker=2"]
    parser, config = parse_args(["--config", str(config), *tiny_overrides("label_skew"), "--threads=1", *executor])
    recipe = RuntimeRecipe(
        architectures=("cnn_tiny",) * 3,
        seed=0,
        rounds=1,
        config_yaml=parser.dump(config, skip_none=False),
        rebuild=build_objects_from_yaml,
    )
    recipe = pickle.loads(pickle.dumps(recipe))  # what a spawned worker receives: rebuild pickled by reference
    assert recipe.rebuild is build_objects_from_yaml
    before = torch.get_num_threads()
    try:
        runtime = build_worker_runtime(recipe, config.federation.executor.init_args.threads_per_worker)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert runtime.scenario.num_clients == 3
