"""Process-executor workers end with their driver, however the driver ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    """Running or sleeping; a zombie (dead, not yet reaped by its new parent) counts as gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    state = next(line for line in status.splitlines() if line.startswith("State:"))
    return "Z" not in state.split()[1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_exit_within_a_second_of_a_kill_9_of_their_driver(tmp_path):
    """A kill -9 of a driver whose two workers are mid-step: both workers are gone within 1 s (was ~12 s)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    driver = subprocess.Popen(
        [sys.executable, "-m", "tests.federation._spinning_workers", str(tmp_path)], cwd=ROOT, env=env
    )
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.iterdir())) < 2:  # both workers started and are spinning
            assert driver.poll() is None and time.monotonic() < deadline, "workers did not start"
            time.sleep(0.1)
        workers = [int(p.name) for p in tmp_path.iterdir()]
        assert all(_alive(pid) for pid in workers)
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        killed = time.monotonic()
        while any(_alive(pid) for pid in workers) and time.monotonic() - killed < 5:
            time.sleep(0.02)
        gone_after = time.monotonic() - killed
        assert not any(_alive(pid) for pid in workers), "workers outlived their driver by 5 s"
        print(f"workers gone {gone_after:.3f} s after the kill")
        assert gone_after < 1.0, gone_after
    finally:
        if driver.poll() is None:
            driver.kill()
        for path in tmp_path.iterdir():  # never leave a spinning worker behind, whatever failed
            try:
                os.kill(int(path.name), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
