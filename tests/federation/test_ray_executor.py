"""RayExecutor: the sequential executor's numbers, joining a running cluster, worker errors in one line.

Ray is an optional extra (``pip install 'fedhet[ray]'``); without it these tests are skipped.
Starting Ray costs seconds, so the tests are few and tiny: the error test reuses the cluster
started for the join test.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'fedhet[ray]'); CI installs .[dev] only")

from fedhet.algorithms import FedProx  # noqa: E402
from fedhet.cli import main  # noqa: E402
from fedhet.errors import ConfigError  # noqa: E402
from fedhet.federation import FederationLoop, FederationSettings, RayExecutor  # noqa: E402
from fedhet.federation.trainer import TrainerTemplate  # noqa: E402
from tests.conftest import tiny_label_skew, tiny_overrides  # noqa: E402
from tests.federation.test_contract_v2 import _state_hash  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs/experiments/digits_dir/fedproto.yaml")


def _loop(executor=None, rounds=2, callbacks=()):
    """A tiny FedProx run (3 clients, cnn_tiny) on ``executor``."""
    scenario = tiny_label_skew()
    scenario.setup()
    trainer = TrainerTemplate(max_epochs=1, accelerator="cpu")
    return FederationLoop(
        FedProx(mu=0.01, lr=0.05),
        scenario,
        ["cnn_tiny"] * 3,
        trainer,
        rounds=rounds,
        settings=FederationSettings(executor=executor),
        callbacks=callbacks,
    )


class _ClientEnds:
    """Records the loop's per-client progress calls (``on_client_end(loop, step, done, total)``)."""

    def __init__(self):
        self.calls = []

    def on_client_end(self, loop, step_idx, done, total):
        """Keep the call."""
        self.calls.append((step_idx, done, total))

    def on_round_end(self, loop, record):
        """Nothing to do."""

    def on_run_end(self, loop, summary):
        """Nothing to do."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def ray_head():
    """A Ray head node on localhost (2 CPUs) in its own process; its address, then it is stopped by pid."""
    if ray.is_initialized():
        ray.shutdown()
    ray_cli = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
    port = _free_port()
    temp_dir = tempfile.mkdtemp(prefix="fhray")  # short: Ray's socket paths are length-limited
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    command = [
        ray_cli, "start", "--head", "--block", f"--port={port}", "--num-cpus=2", "--num-gpus=0",
        "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}",
        f"--ray-client-server-port={_free_port()}", f"--dashboard-agent-listen-port={_free_port()}",
        f"--dashboard-agent-grpc-port={_free_port()}", f"--metrics-export-port={_free_port()}",
        f"--runtime-env-agent-port={_free_port()}",
    ]  # fmt: skip
    head = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    status = [ray_cli, "status", f"--address={address}"]
    while subprocess.run(status, env=env, capture_output=True).returncode != 0:
        if head.poll() is not None:
            pytest.fail(f"ray start --head exited with {head.returncode}: {head.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            head.terminate()
            pytest.fail("the Ray head did not come up within 120 s")
        time.sleep(1)
    yield address
    if ray.is_initialized():
        ray.shutdown()
    head.terminate()  # `ray start --block` stops the processes it started when terminated
    try:
        head.wait(timeout=60)
    except subprocess.TimeoutExpired:
        head.kill()
        head.wait()
    shutil.rmtree(temp_dir, ignore_errors=True)


def test_ray_executor_gives_the_sequential_numbers():
    """Local Ray (2 actors x 1 thread) equals the in-process run at 1 thread: metrics, bytes, every state.

    States stay on the worker that trained them: after the first fits (fresh clients), each of the
    three calls (evaluation, fit, evaluation) starts both idle workers on a client they keep, so at
    least 6 of the 9 tasks that need a state find it there; the rest are sent.
    """
    if ray.is_initialized():
        ray.shutdown()
    torch.set_num_threads(1)
    try:
        sequential = _loop()
        expected = sequential.run()
        progress = _ClientEnds()
        parallel = _loop(RayExecutor(workers=2, threads_per_worker=1), callbacks=[progress])
        workers_fedhet = parallel.executor.worker_fedhet
        got = parallel.run()
    finally:
        torch.set_num_threads(2)
    assert workers_fedhet == [str(ROOT / "fedhet" / "__init__.py")] * 2  # the workers ran this checkout
    executor = parallel.executor
    assert executor.states_kept + executor.states_sent == 9 and executor.states_kept >= 6
    assert got["final"] == expected["final"] and got["comm"] == expected["comm"]
    for cid in range(3):
        assert _state_hash(parallel.store.get(cid)) == _state_hash(sequential.store.get(cid))
    assert progress.calls == [(step, done, 3) for step in (0, 1) for done in (1, 2, 3)]  # as results arrive
    assert parallel.executor._actors == [] and not ray.is_initialized()  # the executor stopped the Ray it started


def test_ray_executor_joins_a_running_cluster_from_the_config(ray_head, tmp_path, capsys):
    """federation.executor with an address runs a round on the head node and leaves the cluster running."""
    executor = f'{{"class_path": "fedhet.federation.RayExecutor", "init_args": {{"address": "{ray_head}"}}}}'
    args = ["--config", CONFIG, *tiny_overrides("label_skew"), "--rounds=1", f"--run_dir={tmp_path / 'run'}"]
    code = main(["fit", *args, f"--federation.executor={executor}"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert (tmp_path / "run" / "summary.json").exists()
    ray.init(address=ray_head, logging_level="ERROR")  # the joined cluster is still up
    try:
        assert ray.cluster_resources()["CPU"] == 2
    finally:
        ray.shutdown()


def test_worker_error_is_one_line(ray_head, tmp_path, capsys):
    """A diverging client in a Ray worker stops the run with fedhet's one-line error, no traceback."""
    executor = f'{{"class_path": "fedhet.federation.RayExecutor", "init_args": {{"address": "{ray_head}"}}}}'
    args = ["--config", CONFIG, *tiny_overrides("label_skew"), "--rounds=1", "--method.lr=1e30"]
    code = main(["fit", *args, f"--run_dir={tmp_path / 'run'}", f"--federation.executor={executor}"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("fedhet: error:")]
    assert code != 0 and "Traceback" not in err and "RayTaskError" not in err
    assert len(lines) == 1 and "non-finite training loss" in lines[0] and "lower method.lr" in lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_ray_executor_refuses_gpus_a_machine_lacks():
    """Asking a local instance for GPUs this machine lacks is one ConfigError before Ray starts."""
    if ray.is_initialized():
        ray.shutdown()
    with pytest.raises(ConfigError, match="no GPU"):
        _loop(RayExecutor(workers=1, gpus_per_worker=0.5), rounds=1)
    assert not ray.is_initialized()
