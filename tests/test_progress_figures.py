"""Round progress (ETA, client progress, terminal vs plain output), run figures and the summarised matrix."""

from __future__ import annotations

import io
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from fedhet.tracking import ConsoleCallback, format_summary
from fedhet.tracking.console import summarise_matrix
from fedhet.tracking.progress import RoundProgress, eta_seconds, format_duration
from tests.conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[1]
DIGITS = str(ROOT / "configs/experiments/digits/fedproto.yaml")
PNG = b"\x89PNG\r\n\x1a\n"


class Clock:
    """A settable time source."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Lines(logging.Handler):
    """Collects the messages of the ``fedhet`` logger (which the command line keeps from propagating)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def fedhet_log():
    """The ``fedhet`` logger's INFO messages during a test."""
    logger = logging.getLogger("fedhet")
    handler, level = Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.messages
    logger.removeHandler(handler)
    logger.setLevel(level)


def _record(round_idx: int, round_s: float, fit_s: float) -> dict:
    return {
        "round": round_idx, "train/loss": 1.0, "acc_intra": 50.0, "acc_inter": 40.0, "comm/bytes_up": 1e6,
        "comm/bytes_down": 2e6, "time/round_s": round_s, "time/fit_s": fit_s,
    }


def test_eta_math():
    """ETA between rounds, inside a round (from its own client progress or from earlier rounds), and unknown."""
    assert eta_seconds(10, 4, 30.0) == 180.0  # 6 rounds left at 30 s
    assert eta_seconds(10, 10, 30.0) == 0.0
    assert eta_seconds(10, 0, None) is None  # nothing measured yet
    assert eta_seconds(10, 0, None, round_elapsed=5.0, round_fraction=0.0) is None
    # round 1 of 10, a quarter done after 10 s: this round ends in 30 s, nine more at 40 s
    assert eta_seconds(10, 0, None, round_elapsed=10.0, round_fraction=0.25) == pytest.approx(30.0 + 9 * 40.0)
    # earlier rounds took 20 s; this one is half done after 15 s (so 30 s): 15 s left + 5 rounds x 20 s
    assert eta_seconds(7, 1, 20.0, round_elapsed=15.0, round_fraction=0.5) == pytest.approx(15.0 + 5 * 20.0)
    # no client done yet: the current round is taken to last as long as the earlier ones
    assert eta_seconds(3, 1, 20.0, round_elapsed=5.0, round_fraction=0.0) == pytest.approx(15.0 + 20.0)
    assert [format_duration(s) for s in (None, 0, 59.6, 61, 3600 + 62)] == ["?", "0:00", "1:00", "1:01", "1:01:02"]


def test_round_time_includes_what_happens_between_rounds():
    """The ETA uses start-to-start round times: checkpoints and logging after a round count too."""
    clock = Clock()
    progress = RoundProgress(stream=io.StringIO(), live=False, clock=clock)
    loop = SimpleNamespace(rounds=5, elapsed_s=0.0)
    progress.on_round_start(loop, 0, 2)
    clock.now += 10.0
    assert progress.round_end(_record(0, 8.0, 6.0)) == "elapsed 0:10  eta 0:40"
    clock.now += 5.0  # the checkpoint and the other callbacks
    progress.on_round_start(loop, 1, 2)
    assert progress.seconds_per_round() == 15.0
    resumed = RoundProgress(stream=io.StringIO(), live=False, clock=clock)
    resumed.on_round_start(SimpleNamespace(rounds=5, elapsed_s=60.0), 3, 2)  # a resumed run: 3 rounds in 60 s
    assert resumed.seconds_per_round() == 20.0 and resumed.line().endswith("elapsed 1:00  eta 0:40")


def test_plain_progress_prints_round_lines_with_eta(fedhet_log):
    """Without a terminal: plain round lines with elapsed and ETA, and a progress line inside a long round."""
    clock = Clock()
    stream = io.StringIO()
    console = ConsoleCallback(RoundProgress(stream=stream, live=False, plain_interval_s=60.0, clock=clock))
    loop = SimpleNamespace(rounds=4, elapsed_s=0.0)
    for round_idx in range(2):
        console.on_round_start(loop, round_idx, 8)
        for done in range(1, 9):
            clock.now += 10.0  # 80 s of client fits: one plain line after 60 s
            console.on_client_end(loop, round_idx, done, 8)
        console.on_evaluate_start(loop, round_idx)
        clock.now += 20.0
        console.on_round_end(loop, _record(round_idx, 100.0, 80.0))
    lines = fedhet_log
    assert stream.getvalue() == ""  # nothing drawn
    round_lines = [line for line in lines if "acc_intra" in line]
    assert len(round_lines) == 2 and all("\r" not in line for line in lines)
    assert round_lines[0].startswith("round   1/4") and "elapsed 1:40  eta 5:00" in round_lines[0]
    assert round_lines[1].startswith("round   2/4") and "elapsed 3:20  eta 3:20" in round_lines[1]
    progress_lines = [line for line in lines if "clients 6/8" in line]
    assert len(progress_lines) == 2 and "eta" in progress_lines[0]


def test_live_progress_redraws_one_line_on_a_terminal(fedhet_log):
    """On a terminal the client progress is redrawn in place and cleared before the round line."""
    clock = Clock()
    stream = io.StringIO()
    progress = RoundProgress(stream=stream, live=True, clock=clock)
    console = ConsoleCallback(progress)
    loop = SimpleNamespace(rounds=2, elapsed_s=0.0)
    console.on_round_start(loop, 0, 4)
    for done in range(1, 5):
        clock.now += 1.0
        console.on_client_end(loop, 0, done, 4)
    console.on_evaluate_start(loop, 0)
    clock.now += 1.0
    console.on_round_end(loop, _record(0, 5.0, 4.0))
    drawn = stream.getvalue()
    assert "\rround   1/2 [" in drawn and "clients 2/4" in drawn and "clients 4/4" in drawn and "evaluating" in drawn
    assert drawn.endswith("\r\x1b[K")  # cleared before the permanent line
    assert "eta 0:05" in fedhet_log[-1]


def test_console_matrix_is_summarised_above_a_few_dozen_rows():
    """A 100-client matrix prints as statistics per column plus the worst and best clients, not 100 rows."""
    rows = [f"client {i} (cnn_tiny)" for i in range(100)]
    top1 = [[float(i), float(100 - i), 50.0] for i in range(100)]
    matrix = {"rows": rows, "columns": ["mnist", "uci", "mnistm"], "top1": top1}
    labels, values, note = summarise_matrix(matrix)
    assert labels[:6] == ["mean", "min", "25%", "median", "75%", "max"] and "100 clients" in note
    assert values[0] == pytest.approx([49.5, 50.5, 50.0]) and values[1] == [0.0, 1.0, 50.0]
    assert values[3] == pytest.approx([49.5, 50.5, 50.0]) and values[5] == [99.0, 100.0, 50.0]
    assert len(labels) == 12 and labels[6].startswith("worst 1: ") and labels[9].startswith("best 1: ")
    summary = {
        "method": "FedAvg", "scenario": "S", "scenario_kind": "domain_shift", "seed": 0, "rounds": 1, "wall_s": 1.0,
        "final": {"acc_intra": 1.0, "acc_inter": 2.0}, "best": {}, "last3": {},
        "comm": {"bytes_up": 0, "bytes_down": 0}, "matrix": matrix,
    }
    text = format_summary(summary)
    assert "100 clients, summarised" in text and "client 57 " not in text and len(text.splitlines()) < 30
    small = dict(matrix, rows=rows[:3], top1=top1[:3])
    assert summarise_matrix(small) == (rows[:3], top1[:3], None)


def test_tiny_run_writes_figures_and_reports_client_progress(tmp_path, capsys):
    """A real tiny run: curves.png and matrix.png in its run directory; the progress hooks fire per client."""
    from fedhet.cli import fit

    calls = []

    class Recorder:
        def on_round_start(self, loop, round_idx, num_clients):
            calls.append(("start", round_idx, num_clients))

        def on_client_end(self, loop, round_idx, done, total):
            calls.append(("client", round_idx, done, total))

        def on_round_end(self, loop, record):
            pass

        def on_run_end(self, loop, summary):
            pass

    run_dir = tmp_path / "run"
    fit(["--config", DIGITS, *tiny_overrides(), "--rounds", "2", "--run_dir", str(run_dir)], callbacks=[Recorder()])
    for name in ("curves.png", "matrix.png"):
        assert (run_dir / name).read_bytes()[:8] == PNG
    assert not list(run_dir.glob(".*.tmp*"))  # written through temporary files, none left
    assert calls[:4] == [("start", 0, 3), ("client", 0, 1, 3), ("client", 0, 2, 3), ("client", 0, 3, 3)]
    assert calls.count(("start", 1, 3)) == 1 and len(calls) == 8


def test_matrix_figure_of_many_clients(tmp_path):
    """The heatmap of a 100-client matrix is drawn summarised (one PNG, no 100-row image)."""
    from fedhet.tracking.figures import matrix_figure

    matrix = {"rows": [f"client {i}" for i in range(100)], "columns": ["local", "global"],
              "top1": [[float(i % 97), 50.0] for i in range(100)]}
    path = tmp_path / "matrix.png"
    matrix_figure(matrix, path, "FedAvg on S, seed 0")
    assert path.read_bytes()[:8] == PNG and path.stat().st_size < 200_000


def test_wandb_figures_are_a_no_op_when_disabled(tmp_path, monkeypatch):
    """With W&B disabled the callback logs nothing and needs no W&B run."""
    from fedhet.tracking import WandbCallback, WandbConfig

    monkeypatch.setenv("WANDB_MODE", "disabled")
    callback = WandbCallback(WandbConfig(), tmp_path, {}, None)
    (tmp_path / "curves.png").write_bytes(PNG)
    callback.on_run_end(SimpleNamespace(), {"comm": {}})
    assert callback.run is None


def test_server_images_are_kept_every_round_and_drawn_as_a_round_grid(tmp_path):
    """Each round's server images go to images/<name>.pt (uint8, per-image range); a resume drops later steps.

    The run's end draws ``images_<name>.png`` and :func:`figure_paths` lists it (W&B logs it).
    """
    import torch

    from fedhet.tracking.figures import FiguresCallback, figure_paths, load_round_images

    batches = {step: torch.arange(2 * 3 * 4 * 4, dtype=torch.float32).view(2, 3, 4, 4) * (step + 1) - 7.0
               for step in range(3)}
    loop = SimpleNamespace(server=SimpleNamespace(images=lambda: {}), history=[])
    callback = FiguresCallback(tmp_path)
    for step in range(3):
        loop.server.images = lambda step=step: {"class_images": batches[step]}
        callback.on_round_end(loop, {"round": step})
    kept = load_round_images(tmp_path / "images" / "class_images.pt")
    assert sorted(kept) == [0, 1, 2] and kept[1].dtype == torch.uint8
    first = kept[1][0].flatten()
    assert int(first.min()) == 0 and int(first.max()) == 255  # each image stretched over its own range
    assert int(first[24]) == round(24 / 47 * 255)  # pixel 24 of a 48-pixel linear ramp, whatever its scale
    # a resumed run repeats step 1: the killed run's step 2 goes, step 0 stays
    FiguresCallback(tmp_path).on_round_end(loop, {"round": 1})
    assert sorted(load_round_images(tmp_path / "images" / "class_images.pt")) == [0, 1]
    loop.history = [{"round": 0, "train/loss": 1.0}, {"round": 1, "train/loss": 0.5}]
    callback.on_run_end(loop, {"method": "M", "scenario": "S", "seed": 0})
    assert (tmp_path / "images_class_images.png").is_file()
    assert tmp_path / "images_class_images.png" in figure_paths(tmp_path)


def test_a_server_without_images_keeps_none(tmp_path):
    """A server whose images() is empty leaves no images folder."""
    from fedhet.tracking.figures import FiguresCallback

    loop = SimpleNamespace(server=SimpleNamespace(images=lambda: {}), history=[])
    FiguresCallback(tmp_path).on_round_end(loop, {"round": 0})
    assert not (tmp_path / "images").exists()
