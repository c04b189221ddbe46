"""Round progress: elapsed time, ETA, and client progress inside a round.

On a terminal (stderr is a TTY) one live line is redrawn as clients finish, e.g.
``round  3/10 [#####...............] clients 12/40  elapsed 1:23  eta 4:56``; it is cleared before
the round's permanent line is logged, so a finished run's output reads as plain per-round lines.
Elsewhere (a log file, a job scheduler, a test) nothing is redrawn: the round lines carry
``elapsed`` and ``eta``, and a round that runs long gets a plain progress line every
``plain_interval_s`` seconds, so a long round of hundreds of clients is not silent.

The loop reports through optional callback hooks (``on_round_start``, ``on_client_end``,
``on_evaluate_start``); observers without them are not called.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from typing import IO, Any

log = logging.getLogger("fedhet")


def format_duration(seconds: float | None) -> str:
    """``m:ss`` or ``h:mm:ss``; ``?`` when unknown."""
    if seconds is None:
        return "?"
    total = max(0, int(round(seconds)))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def eta_seconds(
    rounds_total: int,
    rounds_done: int,
    seconds_per_round: float | None,
    round_elapsed: float = 0.0,
    round_fraction: float | None = None,
) -> float | None:
    """Seconds left in the run.

    Args:
        rounds_total: rounds of the run.
        rounds_done: rounds completed (the current round, if any, is round ``rounds_done``).
        seconds_per_round: mean duration of completed rounds (``None``: none completed yet).
        round_elapsed: seconds since the current round started.
        round_fraction: share of the current round done (``None``: between rounds). Inside a
            round, the current round's length is extrapolated from its own progress when there
            is any (it knows this round's clients), otherwise taken from earlier rounds.

    Returns:
        The estimate, or ``None`` before anything can be estimated.
    """
    remaining = max(0, rounds_total - rounds_done)
    if round_fraction is None:
        return None if seconds_per_round is None else remaining * seconds_per_round
    current = round_elapsed / round_fraction if round_fraction > 0 else seconds_per_round
    if current is None:
        return None
    per_round = seconds_per_round if seconds_per_round is not None else current
    return max(current - round_elapsed, 0.0) + max(0, remaining - 1) * per_round


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM", "") != "dumb"
    except (AttributeError, ValueError):
        return False


class RoundProgress:
    """Tracks round and client timing and draws the live line (see the module docstring).

    Args:
        stream: where the live line goes (default: ``sys.stderr`` at the time of drawing).
        live: redraw a live line (default: when ``stream`` is a terminal).
        plain_interval_s: without a terminal, log a progress line when a round has run this long
            since its start or the previous such line.
        clock: time source (injectable for tests).
    """

    def __init__(
        self,
        stream: IO[str] | None = None,
        live: bool | None = None,
        plain_interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stream = stream
        self._live = live
        self.plain_interval_s = plain_interval_s
        self.clock = clock
        self.started: float | None = None
        self.round_started = 0.0
        self.round_durations: list[float] = []
        self.fit_shares: list[float] = []
        self.clients = (0, 0)
        self.evaluating = False
        self.rounds_total = 0
        self.rounds_done = 0
        self.resumed_elapsed = 0.0
        self.resumed_rounds = 0
        self._last_draw = -1e9
        self._last_plain = 0.0
        self._drawn = False
        self._ended_since_start = False

    @property
    def stream(self) -> IO[str]:
        return self._stream if self._stream is not None else sys.stderr

    @property
    def live(self) -> bool:
        return _is_terminal(self.stream) if self._live is None else self._live

    # ------------------------------------------------------------------ estimates
    def seconds_per_round(self) -> float | None:
        """Mean round time in this process, or of the earlier process for a resumed run."""
        if self.round_durations:
            return sum(self.round_durations) / len(self.round_durations)
        if self.resumed_rounds:
            return self.resumed_elapsed / self.resumed_rounds
        return None

    def round_fraction(self) -> float:
        """Share of the current round done: client fits weighted by their share of earlier rounds' time.

        Before any round has ended, fits are taken as 90% of a round (evaluation the rest).
        """
        fit_share = sum(self.fit_shares) / len(self.fit_shares) if self.fit_shares else 0.9
        done, total = self.clients
        if self.evaluating:
            return fit_share
        return fit_share * done / total if total else 0.0

    def elapsed(self) -> float:
        return self.resumed_elapsed + (self.clock() - self.started if self.started is not None else 0.0)

    def eta(self, in_round: bool) -> float | None:
        fraction = self.round_fraction() if in_round else None
        return eta_seconds(
            self.rounds_total, self.rounds_done, self.seconds_per_round(), self.clock() - self.round_started, fraction
        )

    # ------------------------------------------------------------------ loop hooks
    def on_round_start(self, loop: Any, round_idx: int, num_clients: int) -> None:
        now = self.clock()
        if self.started is None:
            self.started = now
            self.rounds_total = len(getattr(loop, "schedule", ())) or int(loop.rounds)
            self.resumed_rounds = int(round_idx)
            self.resumed_elapsed = float(getattr(loop, "elapsed_s", 0.0)) if round_idx else 0.0
        elif self._ended_since_start:
            # the full start-to-start time: the round plus its checkpoint and logging, which the
            # user waits for as well (they are not in the record's time/round_s)
            self.round_durations[-1] = now - self.round_started
        self._ended_since_start = False
        self.rounds_done = int(round_idx)
        self.round_started = now
        self._last_plain = now
        self.clients = (0, int(num_clients))
        self.evaluating = False
        self._draw(force=True)

    def on_client_end(self, loop: Any, round_idx: int, done: int, total: int) -> None:
        self.clients = (int(done), int(total))
        self._draw(force=done == total)

    def on_evaluate_start(self, loop: Any, round_idx: int) -> None:
        self.evaluating = True
        self._draw(force=True)

    def round_end(self, record: dict[str, Any]) -> str:
        """Account for the finished round, clear the live line; returns ``elapsed .. eta ..`` for the round line."""
        self.clear()
        if self.started is None:  # driven without the start hook (an older loop): time from the records
            self.started = self.clock() - float(record.get("time/round_s", 0.0))
            duration = float(record.get("time/round_s", 0.0))
        else:  # provisional until the next round starts (see on_round_start)
            duration = self.clock() - self.round_started
            self._ended_since_start = True
        self.round_durations.append(duration)
        if duration > 0 and "time/fit_s" in record:
            self.fit_shares.append(min(1.0, float(record["time/fit_s"]) / duration))
        self.rounds_done = int(record["round"]) + 1
        self.evaluating = False
        return f"elapsed {format_duration(self.elapsed())}  eta {format_duration(self.eta(in_round=False))}"

    # ------------------------------------------------------------------ drawing
    def line(self) -> str:
        """The progress line of the current round (without terminal control characters)."""
        width = 20
        overall = (self.rounds_done + self.round_fraction()) / self.rounds_total if self.rounds_total else 0.0
        filled = min(width, int(overall * width))
        done, total = self.clients
        phase = "evaluating" if self.evaluating else f"clients {done}/{total}"
        return (
            f"round {self.rounds_done + 1:>3}/{self.rounds_total} [{'#' * filled}{'.' * (width - filled)}] {phase}  "
            f"elapsed {format_duration(self.elapsed())}  eta {format_duration(self.eta(in_round=True))}"
        )

    def _draw(self, force: bool = False) -> None:
        now = self.clock()
        if self.live:
            if not force and now - self._last_draw < 0.1:
                return
            self._last_draw = now
            self.stream.write("\r" + self.line() + "\x1b[K")
            self.stream.flush()
            self._drawn = True
        elif now - self._last_plain >= self.plain_interval_s:
            self._last_plain = now
            log.info(self.line())

    def clear(self) -> None:
        """Erase the live line (before a permanent line is logged)."""
        if self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._drawn = False
