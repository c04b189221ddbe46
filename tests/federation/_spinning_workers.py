"""A driver whose process-executor workers spin forever: the parent-death test kills the driver.

Run as ``python -m tests.federation._spinning_workers READY_DIR``: it starts a two-worker
:class:`~fedhet.federation.ProcessExecutor` from a recipe whose runtime needs no data, gives each
worker a client step that never ends (a pure-Python loop, so it holds the GIL as a training
step's Python code does), and sleeps. Each worker writes its pid into ``READY_DIR`` when its step
starts.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


class SpinningRuntime:
    def fit_client(self, ready_dir: str) -> None:
        (Path(ready_dir) / str(os.getpid())).write_text("spinning")
        count = 0
        while True:
            count += 1


class SpinningRecipe:
    def build(self) -> SpinningRuntime:
        return SpinningRuntime()


def main() -> None:
    from fedhet.federation.executors import ProcessExecutor, _worker_fit

    executor = ProcessExecutor(workers=2)
    executor.start(SpinningRecipe(), runtime=None)  # type: ignore[arg-type]
    for _ in range(2):
        executor._pool.submit(_worker_fit, sys.argv[1])  # type: ignore[union-attr]
    time.sleep(600)


if __name__ == "__main__":
    main()
