"""Executor choice without Ray: the slow-default warning, short names, and a missing Ray in one line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fedhet.cli import _load_yaml, _prepare_args
from fedhet.errors import ConfigError
from fedhet.federation import RayExecutor


def test_executor_short_names_map_to_class_paths():
    """--federation.executor ray|process|sequential and the same names in a config file become class paths."""
    assert _prepare_args(["--federation.executor", "ray"]) == ["--federation.executor=fedhet.federation.RayExecutor"]
    assert _prepare_args(["--federation.executor=Process", "--federation.executor.workers=3"]) == [
        "--federation.executor=fedhet.federation.ProcessExecutor",
        "--federation.executor.workers=3",
    ]
    config = _load_yaml("federation: {executor: {class_path: sequential}}")
    assert config["federation"]["executor"]["class_path"] == "fedhet.federation.SequentialExecutor"


def test_importing_fedhet_never_imports_ray():
    """fedhet, its federation package and the command line import without importing Ray."""
    code = "import sys, fedhet, fedhet.federation, fedhet.cli; assert 'ray' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_missing_ray_is_one_line(monkeypatch):
    """Asking for the Ray executor without Ray installed is one ConfigError saying what to install."""
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ConfigError, match=r"install fedhet\[ray\]") as error:
        RayExecutor(workers=2)
    assert "\n" not in str(error.value)
