"""Human-readable progress: one line per round, and a final table with the accuracy matrix.

Everything goes through the ``fedhet`` logger; the command line attaches a stderr handler.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("fedhet")


def _megabytes(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f} MB"


class ConsoleCallback:
    """Logs a progress line per round."""

    def on_round_end(self, loop: Any, record: dict[str, Any]) -> None:
        parts = [f"round {record['round'] + 1:>3}/{loop.rounds}", f"loss {record['train/loss']:.4f}"]
        for key in ("acc_intra", "acc_inter", "acc_local", "acc_global"):
            if key in record:
                parts.append(f"{key} {record[key]:6.2f}")
        parts.append(f"up {_megabytes(record['comm/bytes_up'])}")
        parts.append(f"down {_megabytes(record['comm/bytes_down'])}")
        parts.append(f"{record['time/round_s']:.1f}s")
        log.info("  ".join(parts))

    def on_run_end(self, loop: Any, summary: dict[str, Any]) -> None:
        """The command line prints :func:`format_summary` itself, after the run directory is final."""


def format_summary(summary: dict[str, Any]) -> str:
    """The end-of-run report: headline metrics (final, best-on-val, last-3 mean) and the matrix."""
    kind = summary.get("scenario_kind")
    if kind == "domain_shift":
        keys = ["acc_intra", "acc_inter"]
    else:
        keys = ["acc_local", "acc_global", "acc_local_mean", "acc_local_std"]
    split = {"test": ", evaluated on the test sets", "val": ", evaluated on the validation sets"}
    evaluated = split.get(summary.get("split", ""), "")
    lines = [
        f"{summary['method']} on {summary['scenario']} ({kind}), seed {summary['seed']}, {summary['rounds']} rounds"
        f"{evaluated}, {summary['wall_s']:.1f}s",
        f"{'metric':<16}{'final':>10}{'best(val)':>12}{'last-3':>10}",
    ]
    for key in keys:
        final = summary["final"].get(key)
        best = summary["best"].get(key)
        last3 = summary.get("last3", {}).get(key)
        cells = [f"{v:10.2f}" if isinstance(v, (int, float)) else f"{'-':>10}" for v in (final, best, last3)]
        lines.append(f"{key:<16}{cells[0]}{cells[1]:>12}{cells[2]}")
    columns = (summary.get("matrix") or {}).get("columns", [])
    domains = [c for c in columns if f"domain/{c}/acc_intra" in summary["final"]]
    if domains:
        lines.append(f"{'domain (final)':<16}{'intra':>10}{'inter':>12}")
        for name in domains:
            intra, inter = summary["final"][f"domain/{name}/acc_intra"], summary["final"][f"domain/{name}/acc_inter"]
            lines.append(f"{name:<16}{intra:10.2f}{inter:12.2f}")
    comm = summary.get("comm")  # absent from re-evaluations (fedhet test / validate): nothing was sent
    if comm:
        up, down = _megabytes(comm["bytes_up"]), _megabytes(comm["bytes_down"])
        lines.append(f"communication: up {up}, down {down} in total")
    matrix = summary.get("matrix") or {}
    if matrix:
        width = max(len(r) for r in matrix["rows"]) + 2
        lines.append("accuracy matrix (%, final round; rows: client model, columns: test set)")
        lines.append(" " * width + "".join(f"{c:>10}" for c in matrix["columns"]))
        for row, values in zip(matrix["rows"], matrix["top1"], strict=True):
            lines.append(f"{row:<{width}}" + "".join(f"{v:10.2f}" for v in values))
    return "\n".join(lines)
