"""Weights & Biases: one run per experiment, ``round`` as the step metric.

Keys follow design.md section 8: ``client/<id>/...``, ``domain/<d>/...``, ``server/...``,
``comm/...``; the client x domain accuracy matrix is logged as a table each evaluated round and
the resolved config goes to ``wandb.config``; at the end, the run's figures (``curves.png``,
``matrix.png``, :mod:`fedhet.tracking.figures`) are logged as images. ``mode="offline"`` writes
under the run directory without network (``wandb sync`` uploads later); ``"disabled"`` (or
``WANDB_MODE=disabled``, as the tests set) makes every call a no-op. A run started by
``wandb agent`` (``WANDB_SWEEP_ID`` set) logs online unless ``WANDB_MODE`` says otherwise: the
sweep server chooses the next runs from the metrics it receives. The W&B run id is stored in the checkpoint so that
``--resume`` continues the same W&B run.

``mode="online"`` without W&B credentials (no ``WANDB_API_KEY``, no ``wandb login`` entry in
``~/.netrc``) would make ``wandb.init`` prompt or fail after the run has started; such a run logs
offline instead (the command line says so in one warning line), and ``wandb sync`` uploads it later.

With credentials but no way to the server (no network, a firewall, a wrong key), ``wandb.init``
used to wait 90 s and end the run with a ``CommError`` traceback. Online runs now give the server
:data:`INIT_TIMEOUT_S` seconds (``WANDB_INIT_TIMEOUT`` overrides it), then log offline with one
warning line, after removing what the failed attempt left under ``<run_dir>/wandb/``; if even
offline logging cannot start, the run goes on without W&B (its own files hold every number).
"""

from __future__ import annotations

import logging
import netrc
import os
import shutil
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

WandbMode = Literal["online", "offline", "disabled"]

#: Seconds an online run waits for the W&B server before it logs offline (W&B's own default is 90).
INIT_TIMEOUT_S = 10.0

log = logging.getLogger("fedhet")


class WandbConfig:
    """W&B settings of a run.

    Args:
        mode: ``"online"``, ``"offline"`` (no network; sync later) or ``"disabled"``. The
            ``WANDB_MODE`` environment variable, when set, wins.
        project: W&B project.
        entity: W&B entity (team or user); ``None`` for the default.
        group: run group (e.g. one per sweep or per seed set).
        name: run name (default: W&B's).
        tags: run tags.
    """

    def __init__(
        self,
        mode: WandbMode = "offline",
        project: str = "fedhet",
        entity: str | None = None,
        group: str | None = None,
        name: str | None = None,
        tags: list[str] | None = None,
    ) -> None:
        self.mode = mode
        self.project = project
        self.entity = entity
        self.group = group
        self.name = name
        self.tags = list(tags or [])

    def requested_mode(self) -> str:
        """The mode asked for: ``WANDB_MODE`` when set, else :attr:`mode`.

        An offline-configured run started by ``wandb agent`` logs online: the agent's sweep server
        needs its metrics (docs/sweeps.md).
        """
        if "WANDB_MODE" in os.environ:
            return os.environ["WANDB_MODE"]
        if os.environ.get("WANDB_SWEEP_ID") and self.mode == "offline":
            return "online"
        return self.mode

    def effective_mode(self) -> str:
        """The mode the run logs in: the requested one, but ``"offline"`` for online without credentials."""
        mode = self.requested_mode()
        return "offline" if mode == "online" and not wandb_credentials_available() else mode


def wandb_credentials_available() -> bool:
    """Whether ``wandb.init`` would find credentials for the W&B server without prompting.

    Checks the places W&B itself reads (``wandb/sdk/lib/wbauth``): ``WANDB_API_KEY`` or
    ``WANDB_IDENTITY_TOKEN_FILE``, else a ``.netrc`` entry for the server's host (``NETRC``, else
    ``~/.netrc`` or ``~/_netrc``; ``wandb login`` writes it). The key itself is not checked (that
    needs the network); reading the files here avoids importing wandb (about a second) up front.
    """
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).netloc
    if os.environ.get("NETRC"):
        paths = [Path(os.environ["NETRC"]).expanduser()]
    else:
        paths = [Path("~/.netrc").expanduser(), Path("~/_netrc").expanduser()]
    for path in paths:
        if path.is_file():
            try:
                entry = netrc.netrc(str(path)).authenticators(host)
            except (netrc.NetrcParseError, OSError):
                return False
            return bool(entry and entry[2])
    return False


def init_timeout() -> float:
    """Seconds an online ``wandb.init`` may wait for the server: ``WANDB_INIT_TIMEOUT``, else :data:`INIT_TIMEOUT_S`."""
    try:
        return float(os.environ.get("WANDB_INIT_TIMEOUT", INIT_TIMEOUT_S))
    except ValueError:
        return INIT_TIMEOUT_S


class WandbCallback:
    """Round callback logging to one W&B run (a no-op when disabled)."""

    def __init__(self, config: WandbConfig, run_dir: Path, resolved_config: dict[str, Any], run_id: str | None) -> None:
        self.run = None
        self.run_id = run_id
        self.run_dir = Path(run_dir)
        if config.effective_mode() == "disabled":
            return
        import wandb

        self._wandb = wandb
        mode = config.effective_mode()
        arguments = dict(
            project=config.project,
            entity=config.entity,
            group=config.group,
            name=config.name,
            tags=config.tags,
            dir=str(run_dir),
            config=resolved_config,
            id=run_id,
            resume="allow" if run_id else None,
        )
        self.run = self._init(mode, arguments)
        if self.run is None and mode == "online":
            self.run = self._init("offline", arguments)
        if self.run is None:
            return
        self.run_id = self.run.id
        self.run.define_metric("round")
        for prefix in ("acc*", "val/*", "client/*", "domain/*", "server/*", "comm/*", "train/*", "time/*"):
            self.run.define_metric(prefix, step_metric="round")

    def _init(self, mode: str, arguments: dict[str, Any]) -> Any:
        """``wandb.init`` in ``mode``, or ``None`` after one warning line when it fails.

        What a failed attempt wrote under ``<run_dir>/wandb/`` (a ``run-*`` folder, the
        ``latest-run`` and log links) is removed, so no half-made W&B run is left to sync.
        """
        wandb = self._wandb
        folder = self.run_dir / "wandb"
        before = set(folder.iterdir()) if folder.is_dir() else None
        settings: dict[str, Any] = {"console": "off", "silent": True}
        if mode == "online":
            settings["init_timeout"] = init_timeout()
        try:
            return wandb.init(mode=mode, settings=wandb.Settings(**settings), **arguments)
        except Exception as exc:  # noqa: BLE001 - any failure to start logging must not end the run
            reason = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
            reason = reason if len(reason) <= 160 else reason[:157] + "..."
        try:
            wandb.finish(exit_code=1)  # a run object the failed init may have left behind
        except Exception:  # noqa: BLE001
            pass
        if folder.is_dir():
            for path in set(folder.iterdir()) - (before or set()):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
            if before is None and not any(folder.iterdir()):
                folder.rmdir()
        if mode == "online":
            log.warning(
                "fedhet: warning: W&B could not start online (%s); logging offline into the run directory "
                "instead, upload it later with 'wandb sync'",
                reason,
            )
        else:
            log.warning("fedhet: warning: W&B could not start (%s); the run continues without W&B", reason)
        return None

    def on_round_end(self, loop: Any, record: dict[str, Any]) -> None:
        if self.run is None:
            return
        payload: dict[str, Any] = dict(record)
        if loop.last_matrix and ("acc_intra" in record or "acc_local" in record):
            matrix = loop.last_matrix
            payload["matrix/client_x_eval"] = self._wandb.Table(
                columns=["client", *matrix["columns"]],
                data=[[row, *values] for row, values in zip(matrix["rows"], matrix["top1"], strict=True)],
            )
        self.run.log(payload)

    def on_run_end(self, loop: Any, summary: dict[str, Any]) -> None:
        if self.run is None:
            return
        from fedhet.tracking.figures import figure_paths

        images = {f"figures/{path.stem}": self._wandb.Image(str(path)) for path in figure_paths(self.run_dir)}
        if images:
            self.run.log(images)
        for block in ("final", "best", "last3"):
            for key, value in summary.get(block, {}).items():
                if isinstance(value, (int, float)):
                    self.run.summary[f"{block}/{key}"] = value
        self.run.summary["comm/bytes_up"] = summary["comm"]["bytes_up"]
        self.run.summary["comm/bytes_down"] = summary["comm"]["bytes_down"]
        self.run.summary["wall_s"] = summary["wall_s"]
        for key, reached in summary.get("rounds_to_target", {}).items():
            self.run.summary[f"rounds_to_target/{key}"] = reached  # None (never reached) is kept as null
        self.run.finish()

    def abort(self) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1)
