"""``import fedhet.data`` must have no side effects (design section 2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_import_builds_nothing_and_touches_no_file(tmp_path: Path) -> None:
    """Importing fedhet.data builds no dataset, loads no data source, prints and writes nothing."""
    cache = tmp_path / "cache-that-must-not-appear"
    code = (
        "import logging, sys\n"
        "import fedhet.data as data\n"
        "assert 'mnist' in data.list_datasets()\n"
        "assert not logging.getLogger().handlers, 'import configured logging'\n"
        "assert 'sklearn' not in sys.modules and 'skimage' not in sys.modules, 'import loaded data sources'\n"
    )
    env = {**os.environ, "FEDHET_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == ""  # no print() in library code
    assert not cache.exists()
