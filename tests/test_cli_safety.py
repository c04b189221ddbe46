"""Run safety: run directories that never collide, bad values refused before anything is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import yaml

from fedhet.cli import main
from fedhet.errors import ConfigError
from fedhet.tracking import RunDirectory
from fedhet.tracking.wandb_logger import wandb_credentials_available
from tests.conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[1]
SGD_CONFIG = str(ROOT / "configs/experiments/digits/fedproto.yaml")  # (any optimizer)
ADAM_CONFIG = str(ROOT / "configs/experiments/digits/fccl_plus.yaml")  # optimizer: adam
DIR_CONFIG = str(ROOT / "configs/experiments/digits_dir/fd.yaml")


def _fit(args, capsys):
    code = main(["fit", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _only_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


# ----------------------------------------------------------------------------- 1. run directories
def test_claim_gives_each_concurrent_run_its_own_directory(tmp_path):
    """Eight threads claiming the same default name get eight distinct, new directories."""
    claimed: list[Path] = []
    barrier = threading.Barrier(8)

    def claim() -> None:
        barrier.wait()
        claimed.append(RunDirectory.claim(tmp_path / "runs" / "fedproto-20260101-000000-s0", unique=True).path)

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(claimed)) == 8
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(p.name for p in claimed)


@pytest.mark.slow
def test_two_runs_started_in_the_same_second_stay_whole_and_separate(tmp_path):
    """Two processes, same method, seed and second, no --run_dir: two directories, each a whole run."""
    pin_clock = (
        "import sys, time; time.strftime = lambda *a, **k: '20260101-000000'; "
        "from fedhet.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", pin_clock, "fit", "--config", SGD_CONFIG, *tiny_overrides(), f"--rounds={rounds}"],
            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        for rounds in (1, 2)
    ]
    errors = [process.communicate(timeout=300)[1] for process in processes]
    assert [process.returncode for process in processes] == [0, 0], errors
    runs = sorted((tmp_path / "runs").iterdir())
    assert [run.name for run in runs] == ["fedproto-20260101-000000-s0", "fedproto-20260101-000000-s0-2"]
    rounds_seen = set()
    for run in runs:
        config = yaml.safe_load((run / "config.yaml").read_text())
        summary = json.loads((run / "summary.json").read_text())
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert config["rounds"] == summary["rounds"] == len(metrics)
        assert [m["round"] for m in metrics] == list(range(config["rounds"]))
        rounds_seen.add(config["rounds"])
    assert rounds_seen == {1, 2}


def test_explicit_run_dir_must_be_new_or_empty(tmp_path, capsys):
    """A non-empty --run_dir is refused in one line naming --resume; an empty one is used."""
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    code, _, err = _fit(["--config", SGD_CONFIG, *tiny_overrides(), "--rounds=1", f"--run_dir={busy}"], capsys)
    assert code == 2 and "--resume" in _only_line(err) and "not empty" in err
    assert sorted(p.name for p in busy.iterdir()) == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = _fit(["--config", SGD_CONFIG, *tiny_overrides(), "--rounds=1", f"--run_dir={empty}"], capsys)
    assert code == 0, err
    assert (empty / "summary.json").is_file()


def test_failed_start_leaves_no_directory(tmp_path, capsys, monkeypatch):
    """An incompatible method/scenario pair, found while the loop is built, removes the claimed default directory."""
    monkeypatch.chdir(tmp_path)
    args = ["--config", SGD_CONFIG, *tiny_overrides(), "--method=fedavg", "--federation.state_store=disk"]
    code, _, err = _fit(args, capsys)
    assert code == 2 and "one architecture" in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


# ----------------------------------------------------------------------------- 2. validation first
@pytest.mark.parametrize(
    "config,extra,key,allowed",
    [
        (SGD_CONFIG, ["--method.lr=-0.1"], "method.lr=-0.1", "> 0"),
        (ADAM_CONFIG, ["--method.lr=-0.1"], "method.lr=-0.1", "> 0"),
        (ADAM_CONFIG, ["--method.public_lr=0"], "method.public_lr=0", "> 0"),
        (SGD_CONFIG, ["--method.lam=-1"], "method.lam=-1", ">= 0"),
        (SGD_CONFIG, ["--method.momentum=1.5"], "method.momentum=1.5", "[0, 1)"),
        (SGD_CONFIG, ["--method=fedavg", "--method.lr=0"], "method.lr=0", "> 0"),
        (ADAM_CONFIG, ["--method.temperature=0"], "method.temperature=0", "> 0"),
        (DIR_CONFIG, ["--method.gamma=-0.5"], "method.gamma=-0.5", ">= 0"),
        (SGD_CONFIG, ["--federation.participation=1.5"], "federation.participation=1.5", "(0, 1] or an integer"),
        (SGD_CONFIG, ["--federation.eval_every=0"], "federation.eval_every=0", ">= 1"),
        (SGD_CONFIG, ["--trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches=0", ">= 1"),
        (SGD_CONFIG, ["--rounds=0"], "rounds=0", ">= 1"),
    ],
)
def test_out_of_range_value_is_one_line_before_anything_is_written(config, extra, key, allowed, tmp_path, capsys):
    """The key, the value and the allowed range in one line, exit 2, no run directory."""
    run_dir = tmp_path / "run"
    tiny = tiny_overrides("label_skew" if config == DIR_CONFIG else "domain_shift")
    code, out, err = _fit(["--config", config, *tiny, *extra, f"--run_dir={run_dir}"], capsys)
    line = _only_line(err)
    assert code == 2 and out == ""
    assert line.startswith("fedhet: error: ") and key in line and allowed in line and "Traceback" not in err
    assert not run_dir.exists()


def test_unknown_memory_format_is_one_line_naming_the_choices(tmp_path, capsys):
    """A layout other than contiguous or channels_last: the key, the value and both choices, exit 2."""
    run_dir = tmp_path / "run"
    code, out, err = _fit(["--config", SGD_CONFIG, *tiny_overrides(), "--trainer.memory_format=nhwc",
                           f"--run_dir={run_dir}"], capsys)
    line = _only_line(err)
    assert code == 2 and out == "" and "Traceback" not in err
    assert "trainer.memory_format" in line and "nhwc" in line
    assert "contiguous" in line and "channels_last" in line
    assert not run_dir.exists()


def test_every_method_checks_its_optimizer_ranges():
    """Each registered method's parser rejects lr <= 0, negative weight decay and momentum >= 1."""
    from jsonargparse import ArgumentParser

    from fedhet.algorithms import ALGORITHMS, ServerPlugin

    for cls in ALGORITHMS.values():
        parser = ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(cls, "m")
        parser.parse_args([])  # the defaults are in range
        # a server plugin's client optimizer is its base method's
        key = "m.base.init_args" if issubclass(cls, ServerPlugin) else "m"
        prefix = ["--m.base=fedhet.algorithms.FedAvg"] if issubclass(cls, ServerPlugin) else []
        for bad in (f"--{key}.lr=0", f"--{key}.lr=-1", f"--{key}.weight_decay=-1", f"--{key}.momentum=1"):
            with pytest.raises(Exception, match="restriction"):
                parser.parse_args([*prefix, bad])


def test_python_callers_pass_plain_floats_and_the_cli_builds_plain_numbers():
    """Annotations do not bind Python callers; values built by the command line are plain floats."""
    from fedhet.algorithms import FedProto
    from fedhet.config import build_experiment, build_parser

    assert FedProto(lam=0.5, lr=0.1).hp.lr == 0.1
    parser = build_parser()
    config = parser.parse_args(["--config", SGD_CONFIG, *tiny_overrides(), "--method.lr=0.2"])
    experiment = build_experiment(parser, config)
    assert type(experiment.method.hp.lr) is float and type(experiment.method.hp.lam) is float
    assert type(experiment.objects.trainer.accumulate_grad_batches) is int


@pytest.mark.parametrize("accelerator", ["gpu", "cuda"])
def test_missing_gpu_is_one_line_before_anything_is_written(accelerator, tmp_path, capsys, monkeypatch):
    """--trainer.accelerator gpu without a GPU: one line naming the fix, exit 2, no run directory."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run_dir = tmp_path / "run"
    args = ["--config", SGD_CONFIG, *tiny_overrides(), f"--trainer.accelerator={accelerator}", f"--run_dir={run_dir}"]
    code, _, err = _fit(args, capsys)
    line = _only_line(err)
    assert code == 2 and f"trainer.accelerator={accelerator}" in line and "--trainer.accelerator=cpu" in line
    assert not run_dir.exists()


def _no_wandb_credentials(monkeypatch, tmp_path):
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))


def test_wandb_credentials_are_found_where_wandb_looks(tmp_path, monkeypatch):
    """WANDB_API_KEY or a netrc entry for the W&B host count as credentials; nothing else does."""
    _no_wandb_credentials(monkeypatch, tmp_path)
    assert not wandb_credentials_available()
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "0" * 40 + "\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    assert wandb_credentials_available()
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    assert not wandb_credentials_available()
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    assert wandb_credentials_available()


def test_wandb_online_without_credentials_logs_offline_with_one_warning(tmp_path, capsys, monkeypatch):
    """--wandb.mode online and no login: one warning line, the run completes and logs offline."""
    _no_wandb_credentials(monkeypatch, tmp_path)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    args = ["--config", SGD_CONFIG, *tiny_overrides(), "--rounds=1", "--wandb.mode=online", f"--run_dir={run_dir}"]
    code, _, err = _fit(args, capsys)
    assert code == 0, err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "offline" in warnings[0] and "wandb sync" in warnings[0]
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1


def test_resume_of_a_run_without_checkpoint_proposes_a_rerun_that_works(tmp_path, capsys):
    """A run killed before its first checkpoint cannot continue; the hint's command starts it again."""
    run_dir = tmp_path / "run"
    code, _, err = _fit(["--config", SGD_CONFIG, *tiny_overrides(), "--rounds=1", f"--run_dir={run_dir}"], capsys)
    assert code == 0, err
    for name in ("summary.json", "checkpoint.pt", "metrics.jsonl"):
        (run_dir / name).unlink()
    code, _, err = _fit(["--resume", str(run_dir)], capsys)
    line = _only_line(err)
    assert code == 2 and "no checkpoint.pt" in line
    command = line.split("fedhet fit ", 1)[1].split()
    code, _, err = _fit(command, capsys)
    assert code == 0, err
    assert (Path(f"{run_dir}-rerun") / "summary.json").is_file()


def test_run_directory_claim_refuses_a_file(tmp_path, capsys):
    """A --run_dir that is an existing file is refused as a file (not "not empty"), not overwritten."""
    target = tmp_path / "taken"
    target.write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        RunDirectory.claim(target)
    code, out, err = _fit(["--config", SGD_CONFIG, *tiny_overrides(), f"--run_dir={target}"], capsys)
    line = _only_line(err)
    assert code == 2 and out == "" and f"'{target}' is a file" in line and "not empty" not in line
    assert target.read_text() == "x"


# ----------------------------------------------------------------------------- 3. one run per directory
#: Each of two processes says it is ready, waits for the start instant the test writes to argv[1],
#: then claims the run directories argv[2:] in turn, trial i starting at the same instant
#: (start + 0.25 i) in both, and holds the claim 20 ms before writing config.yaml (the gap of a
#: real run); it prints one JSON line per trial: 0 (proceeded) or the one-line error.
CLAIMER = """
import json, os, sys, time
from fedhet.errors import FedhetError
from fedhet.tracking.rundir import RunDirectory
print("ready", flush=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.005)
start = float(open(sys.argv[1]).read())
for trial, path in enumerate(sys.argv[2:]):
    time.sleep(max(0.0, start + 0.25 * trial - time.time()))
    try:
        run = RunDirectory.claim(path)
        time.sleep(0.02)
        run.create("rounds: 1\\n")
        run.unlock()
        print(json.dumps(0), flush=True)
    except FedhetError as exc:
        print(json.dumps(str(exc)), flush=True)
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


def test_two_processes_claiming_one_run_dir_at_once_exactly_one_proceeds(tmp_path):
    """20 trials of two processes claiming the same --run_dir at the same instant (new or empty): one wins each.

    Before, both found the directory empty (``mkdir`` fails for the second, the directory is still
    empty until the first writes ``config.yaml``) and both ran, interleaving their metrics.
    """
    paths = [tmp_path / f"trial{i}" for i in range(20)]
    for path in paths[::2]:
        path.mkdir()  # half the trials: an empty directory the user made
    import time

    go = tmp_path / "go"
    processes = [
        subprocess.Popen([sys.executable, "-c", CLAIMER, str(go), *map(str, paths)], env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    for process in processes:
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
    staged = tmp_path / "go.tmp"
    staged.write_text(str(time.time() + 0.3))  # both interpreters are up and waiting: start together
    staged.rename(go)
    outputs = [process.communicate(timeout=120) for process in processes]
    results = [[json.loads(line) for line in out.splitlines()] for out, _ in outputs]
    assert [len(r) for r in results] == [20, 20], outputs
    for trial, (first, second) in enumerate(zip(*results, strict=True)):
        assert sorted([first == 0, second == 0]) == [False, True], (trial, first, second)
        refusal = first if first != 0 else second
        assert "\n" not in refusal and ("in use by another fedhet run" in refusal or "not empty" in refusal)
        assert (paths[trial] / "config.yaml").read_text() == "rounds: 1\n"
        assert not (paths[trial] / ".fedhet.lock").exists()  # removed by the winner's unlock


LOCK_HOLDER = """
import sys, time
from fedhet.tracking.rundir import RunDirectory
run = RunDirectory.claim(sys.argv[1])
run.create("rounds: 1\\n")
print("claimed", flush=True)
time.sleep(600)
"""


def test_a_live_run_holds_its_directory_and_a_killed_one_does_not(tmp_path):
    """While its process lives, a run's directory cannot be locked (naming the pid); after kill -9 it can."""
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(run_dir)], env=_env(),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "claimed"
        with pytest.raises(ConfigError, match=f"in use by another fedhet run \\(process {holder.pid}\\)"):
            RunDirectory(run_dir).lock()
    finally:
        holder.kill()
        holder.wait()
    assert (run_dir / ".fedhet.lock").exists()  # the dead process's file stays; its lock died with it
    again = RunDirectory(run_dir)
    again.lock()
    again.unlock()
    assert not (run_dir / ".fedhet.lock").exists()


@pytest.mark.slow
def test_two_fits_given_the_same_run_dir_at_once_one_runs_one_refuses(tmp_path):
    """The issue's reproduction: two `fedhet fit --run_dir X` started together; one exits 0, one exits 2 in one line."""
    run_dir = tmp_path / "shared"
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "fedhet", "fit", "--config", SGD_CONFIG, *tiny_overrides(), "--rounds=2",
             f"--run_dir={run_dir}"],
            cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        for _ in range(2)
    ]
    errors = [process.communicate(timeout=300)[1] for process in processes]
    codes = sorted(process.returncode for process in processes)
    assert codes == [0, 2], errors
    refusal = errors[[p.returncode for p in processes].index(2)]
    [line] = _error_lines(refusal)  # (after the scenario's info line when it lost the race past the early check)
    assert "in use by another fedhet run" in line or "not empty" in line, line
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in metrics] == [0, 1]


# ----------------------------------------------------------------------------- 4. disk faults
def _error_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("fedhet: error")]


def _temporaries(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if ".tmp" in p.name]


def test_full_disk_during_a_checkpoint_is_one_line_and_the_run_resumes(tmp_path, capsys, monkeypatch):
    """ENOSPC writing round 1's checkpoint: one line naming the file and --resume, exit 2, no temporary file.

    Stale temporary files of a killed writer are removed by the resume, which completes the run.
    """
    import errno

    import fedhet.files

    real_fsync = os.fsync
    calls = []

    def full_disk_fsync(fd):
        if ".checkpoint.pt.tmp" in os.readlink(f"/proc/self/fd/{fd}"):
            calls.append(fd)
            if len(calls) == 2:  # round 0's checkpoint is written, round 1's finds the disk full
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(fedhet.files.os, "fsync", full_disk_fsync)
    run_dir = tmp_path / "run"
    code, _, err = _fit(["--config", SGD_CONFIG, *tiny_overrides(), "--rounds=3", f"--run_dir={run_dir}"], capsys)
    [line] = _error_lines(err)
    assert code == 2
    assert line == (
        f"fedhet: error: cannot write '{run_dir / 'checkpoint.pt'}': no space left on the device (ENOSPC); "
        f"free space there, then continue the run with 'fedhet fit --resume {run_dir}'"
    )
    assert _temporaries(run_dir) == [] and not (run_dir / ".fedhet.lock").exists()
    monkeypatch.setattr(fedhet.files.os, "fsync", real_fsync)  # space freed
    (run_dir / f".checkpoint.pt.tmp{2**22 + 1}").write_bytes(b"half a checkpoint")  # a killed writer's
    (run_dir / "clients").mkdir()
    (run_dir / f".summary.json.tmp{2**22 + 2}").write_text("{")
    code, _, err = _fit(["--resume", str(run_dir)], capsys)
    assert code == 0, err
    assert _temporaries(run_dir) == []
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in metrics] == [0, 1, 2]


def test_a_full_disk_appending_metrics_leaves_whole_lines(tmp_path, monkeypatch):
    """A metrics line cut off by ENOSPC is removed again: the file holds the earlier lines, byte for byte."""
    import errno

    from fedhet.errors import DiskError
    from fedhet.tracking import rundir

    run = RunDirectory(tmp_path)
    run.append_metrics({"round": 0, "acc": 50.0})
    before = run.metrics_path.read_bytes()
    real_write = os.write

    def half_then_full(fd, data):
        real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(rundir.os, "write", half_then_full)
    with pytest.raises(DiskError, match="metrics.jsonl': no space left on the device \\(ENOSPC\\)"):
        run.append_metrics({"round": 1, "acc": 60.0})
    assert run.metrics_path.read_bytes() == before == b'{"acc": 50.0, "round": 0}\n'


@pytest.mark.parametrize("name", ["empty", "new"])
def test_a_read_only_run_directory_is_one_line_with_nothing_written_without_a_mount(name, tmp_path, capsys,
                                                                                      monkeypatch):
    """The read-only case everywhere (CI included): the file system's answers injected under one folder.

    What a read-only mount answers, for every path under ``read_only``: ``access(W_OK)`` is False
    (root included), and creating a directory or a file fails with EROFS. The run must say so in
    one line before any work and leave the folder as it was.
    """
    import errno

    read_only = tmp_path / "ro"
    (read_only / "empty").mkdir(parents=True)
    real_access, real_mkdir, real_open = os.access, os.mkdir, os.open

    def inside(path) -> bool:
        return Path(os.fsdecode(path)).resolve().is_relative_to(read_only.resolve())

    def erofs(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(path))

    def access(path, mode, *args, **kwargs):
        return False if mode & os.W_OK and inside(path) else real_access(path, mode, *args, **kwargs)

    def mkdir(path, *args, **kwargs):
        return erofs(path) if inside(path) else real_mkdir(path, *args, **kwargs)

    def open_(path, flags, *args, **kwargs):
        writes = flags & (os.O_CREAT | os.O_WRONLY | os.O_RDWR | os.O_APPEND)
        return erofs(path) if writes and inside(path) else real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)
    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "open", open_)
    run_dir = read_only / name
    code, out, err = _fit(["--config", SGD_CONFIG, *tiny_overrides(), f"--run_dir={run_dir}"], capsys)
    line = _only_line(err)
    assert code == 2 and out == "", err
    assert line == (
        f"fedhet: error: cannot write '{read_only if name == 'new' else run_dir}': it is read-only (a read-only "
        "file system or no write permission); make it writable, or choose another --run_dir"
    )
    assert [p.name for p in read_only.rglob("*")] == ["empty"]


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 128 KiB tmpfs (mounting needs root with CAP_SYS_ADMIN; skipped elsewhere)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow
def test_a_really_full_tmpfs_gives_one_line_and_no_temporary_file(small_tmpfs, capsys):
    """A run on a 128 KiB tmpfs fills it: one line naming a file there and ENOSPC, exit 2, no temporary file."""
    run_dir = small_tmpfs / "run"
    code, _, err = _fit(["--config", SGD_CONFIG, *tiny_overrides(), "--rounds=3", f"--run_dir={run_dir}"], capsys)
    [line] = _error_lines(err)
    assert code == 2 and f"cannot write '{run_dir}" in line and "(ENOSPC)" in line, err
    assert _temporaries(small_tmpfs) == []


def test_a_read_only_run_directory_is_one_line_with_nothing_written(small_tmpfs, capsys):
    """An empty --run_dir, or a new one, on a read-only file system: one line (EROFS), exit 2, nothing written."""
    (small_tmpfs / "empty").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    for run_dir in (small_tmpfs / "empty", small_tmpfs / "new"):
        code, out, err = _fit(["--config", SGD_CONFIG, *tiny_overrides(), f"--run_dir={run_dir}"], capsys)
        line = _only_line(err)
        assert code == 2 and out == "" and "read-only" in line and "make it writable" in line, line
        assert f"cannot write '{small_tmpfs if run_dir.name == 'new' else run_dir}'" in line
    assert [p.name for p in small_tmpfs.rglob("*")] == ["empty"]


# ----------------------------------------------------------------------------- 5. W&B without a network
def test_wandb_online_without_a_network_logs_offline_within_the_timeout(tmp_path, capsys, monkeypatch):
    """Credentials set, server unreachable: init gets 10 s (not 90), then one warning line and offline logging.

    The failed attempt's files are removed and the run completes.
    """
    import wandb
    from wandb.errors import CommError

    _no_wandb_credentials(monkeypatch, tmp_path)
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_INIT_TIMEOUT", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    real_init = wandb.init
    timeouts = []

    def unreachable(**kwargs):
        if kwargs["mode"] == "online":
            timeouts.append(kwargs["settings"].init_timeout)
            half = Path(kwargs["dir"]) / "wandb" / "run-20260101_000000-abcdefgh"
            half.mkdir(parents=True)  # what a real failed attempt leaves
            (half / "debug.log").write_text("dial tcp: lookup api.wandb.ai: no such host")
            raise CommError("Timed out while retrying: Post \"https://api.wandb.ai/graphql\": no such host")
        return real_init(**kwargs)

    monkeypatch.setattr(wandb, "init", unreachable)
    run_dir = tmp_path / "run"
    args = ["--config", SGD_CONFIG, *tiny_overrides(), "--rounds=1", "--wandb.mode=online", f"--run_dir={run_dir}"]
    code, _, err = _fit(args, capsys)
    assert code == 0, err
    assert timeouts == [10.0]
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "CommError" in warnings[0] and "offline" in warnings[0], err
    assert "Traceback" not in err
    assert [p.name.split("-")[0] for p in (run_dir / "wandb").iterdir() if p.is_dir() and not p.is_symlink()] == [
        "offline"
    ]
    assert (run_dir / "summary.json").is_file()


# ----------------------------------------------------------------------------- 6. rough edges
@pytest.mark.parametrize(
    "extra,expected",
    [
        (["--method.lr", "fast"],
         "method.lr=fast is not a valid value: it must be a number > 0; set --method.lr to such a value"),
        (["--federation.participation=fast"],
         "federation.participation=fast is not a valid value: it must be a number in (0, 1] or an integer >= 1"),
        (["--federation.eval_every=1.5"], "federation.eval_every=1.5 is not a valid value: it must be an integer >= 1"),
        (["--trainer.max_epochs=x"], "trainer.max_epochs=x is not a valid value: it must be an integer"),
        (["--federation.executor", "bogus"],
         "federation.executor=bogus is not an executor; use one of sequential, process, ray"),
        (["--federation.state_store", "bogus"],
         "federation.state_store=bogus is not a valid value: it must be one of 'auto', 'memory', 'disk'; "
         "set --federation.state_store to such a value"),
        (["--method.init_args.optimizer", "lbfgs"],  # a knob's choices, inside the method's class union
         "method.optimizer=lbfgs is not a valid value: it must be one of 'sgd', 'adam', 'adamw'; "
         "set --method.optimizer to such a value"),
    ],
)
def test_a_mistyped_value_is_one_short_line(extra, expected, tmp_path, capsys):
    """A value of the wrong type: key, value and what is expected in one short line (was a 458-character union dump)."""
    run_dir = tmp_path / "run"
    code, out, err = _fit(["--config", SGD_CONFIG, *tiny_overrides(), *extra, f"--run_dir={run_dir}"], capsys)
    line = _only_line(err)
    assert code == 2 and out == "" and expected in line and len(line) < 200, line
    assert "<class" not in line and "Union" not in line
    assert not run_dir.exists()


def test_an_unknown_executor_in_a_config_file_names_the_file_and_the_executors(tmp_path, capsys):
    """federation.executor: bogus in a YAML config: one line naming the file and sequential, process, ray."""
    config = tmp_path / "bad.yaml"
    config.write_text("federation:\n  executor: bogus\n")
    code, _, err = _fit(["--config", SGD_CONFIG, "--config", str(config), f"--run_dir={tmp_path / 'run'}"], capsys)
    line = _only_line(err)
    assert code == 2 and f"config file '{config}'" in line and "sequential, process, ray" in line
