"""What the scaling benchmarks share: child processes that report JSON, peak memory, machine load.

Each configuration of ``htfe2_round.py``, ``scale_clients.py`` and ``ray_efficiency.py`` runs in a
child process of its own, so its peak resident set size is its own and a crash stays in it; the
parent runs the children one after another in one invocation and prints ratios between them.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MARK = "FEDHET_BENCH_RESULT "


def report(result: dict) -> None:
    """Print a child's measurements where :func:`run_child` finds them."""
    print(MARK + json.dumps(result), flush=True)


def run_child(script: str, args: Sequence[str], threads: int, what: str) -> dict:
    """Run ``python script args`` with ``threads`` intra-op threads; the JSON it :func:`report`-ed."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "MKL_DYNAMIC": "FALSE",
    }
    done = subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{what} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len(MARK) :])


def peak_rss_gb(pid: int | str = "self") -> float:
    """Peak resident set size of a process (Linux ``VmHWM``), in GB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024**2
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def tree_pss_gb(root: int | None = None) -> float:
    """Proportional set size of ``root`` (default: this process) and every process below it, in GB.

    Peak RSS summed over processes counts each page shared between them (the torch and Ray
    libraries every worker maps, Ray's object store) once per process; the PSS of a page is its
    size divided by the number of processes mapping it, so the tree's sum counts what the tree
    holds once, and Ray's raylet and object store (children of the driver) count too. It is a
    snapshot, not a peak (the kernel keeps no peak PSS); only meaningful when no process outside
    the tree maps the same libraries (no other torch job running: their share would be divided
    away).
    """
    total_kb = 0
    for pid in _descendants(os.getpid() if root is None else root, include_root=True):
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        total_kb += next((int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Pss:")), 0)
    return total_kb / 1024**2


def _descendants(root: int, include_root: bool = False) -> list[int]:
    """The processes below ``root`` (children, their children ...), and ``root`` itself if asked."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = ancestor = int(entry.name)
        if pid == root:
            if include_root:
                pids.append(pid)
            continue
        while ancestor > 1 and ancestor != root:
            ancestor = _parent(ancestor)
        if ancestor == root:
            pids.append(pid)
    return pids


def _parent(pid: int) -> int:
    """The parent process id of ``pid`` (0 when it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def ray_worker_pids() -> list[int]:
    """This process's Ray actors running fedhet clients (``ray::RayClientWorker``).

    A local Ray instance runs its processes under the driver that started it, so only actors
    descending from this process count, not those of other Ray instances on the machine.
    """
    pids = []
    for pid in _descendants(os.getpid()):
        try:
            if b"RayClientWorker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
        except OSError:
            continue
    return pids


def htfllib_scenario(clients: int, seed: int) -> Any:
    """HtFLlib's image workload on the embedded data, set up (``htfe2_round.py``, ``gpu_round.py``).

    The 5,000 MNIST digits (``mnist_all``) at 3x32x32, train and test pooled and split by
    Dirichlet(0.1) with at least 40 per client, each client's share split 75/25 into local train
    and test, batch 10; the global test set cut to 20 images and no global validation set, so
    evaluation costs what HtFLlib's does.
    """
    from fedhet.data import DirichletPartitioner, LabelSkewScenario

    scenario = LabelSkewScenario(
        dataset="mnist_all",
        num_clients=clients,
        partitioner=DirichletPartitioner(beta=0.1, min_size=40),
        pool_train_test=True,
        global_test_size=20,
        global_val_size=0,
        local_test_fraction=0.25,
        local_val_fraction=0.0,
        image_size=32,
        batch_size=10,
        seed=seed,
    )
    scenario.setup()
    return scenario


def family_architectures(family_name: str, clients: int) -> list[str]:
    """Client ``c``'s architecture in a model family (HtFLlib's ``c mod len(family)``)."""
    from fedhet.models import model_for_client, resolve_family

    family = resolve_family(family_name)
    return [model_for_client(family, c) for c in range(clients)]


def load() -> str:
    """The machine's load averages (other users' work shows here)."""
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())
