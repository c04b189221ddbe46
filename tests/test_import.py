"""``import fedhet`` and every subpackage: no side effects (design section 2)."""

from __future__ import annotations

import os
import subprocess
import sys


def test_importing_every_package_has_no_side_effects(tmp_path):
    """Importing every fedhet package changes no cwd, path, warnings or logging, prints and writes nothing."""
    code = (
        "import logging, os, sys, warnings\n"
        # the dependencies' own import effects happen before the snapshot
        "import numpy, torch, torchvision, torchmetrics, lightning.pytorch, jsonargparse, yaml\n"
        "cwd, path, filters = os.getcwd(), list(sys.path), list(warnings.filters)\n"
        "lightning_level = logging.getLogger('lightning.pytorch').level\n"
        "import fedhet, fedhet.cli, fedhet.algorithms, fedhet.federation, fedhet.federation.loop, fedhet.functional\n"
        "import fedhet.metrics, fedhet.models, fedhet.data, fedhet.tracking\n"
        "assert os.getcwd() == cwd and sys.path == path, 'import changed cwd or sys.path'\n"
        "assert list(warnings.filters) == filters, 'import changed warning filters'\n"
        "assert not logging.getLogger().handlers and not logging.getLogger('fedhet').handlers\n"
        "assert logging.getLogger('lightning.pytorch').level == lightning_level, 'import silenced lightning'\n"
    )
    env = {**os.environ, "FEDHET_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", code]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == ""
    assert os.listdir(tmp_path) == []  # nothing written (no cache, no logs)
