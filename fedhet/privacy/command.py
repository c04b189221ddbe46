"""``fedhet attack``: one gradient-inversion cell (:mod:`fedhet.privacy.attack`) into a run directory.

``fedhet attack --config configs/attacks/fedmdcg_table2.yaml --target fedmdcg --seed 0 --run_dir DIR``
attacks the upload of one method (or scores one gradient-free reference row) on the digits of one
seed and writes the run directory in the contract of ``fedhet fit`` (:mod:`fedhet.tracking.rundir`),
so that ``fedhet bench`` runs it as a grid cell (a grid's ``command: attack``) and reads it as any run:

* ``config.yaml``: the resolved settings, the seed and the run directory;
* ``metrics.jsonl``: one line per attacked digit (its index, label and PSNR per attacker knowledge);
* ``summary.json`` (written last, so it marks a complete cell): ``final`` holds the mean over the
  seed's digits of ``psnr_whole_model`` and ``psnr_uploads_only`` (dB) and of the matching losses;
  ``digits`` the per-digit entries, ``method`` the target, ``seed``, ``settings``, ``wall_s`` and
  the ``environment``.

Settings come from ``--config`` (a YAML mapping of the :class:`~fedhet.privacy.attack.AttackSettings`
keys) with flags on top. Every bad setting is one :class:`~fedhet.errors.ConfigError` line (exit 2),
raised before the run directory is claimed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedhet.errors import CommandParser, ConfigError
from fedhet.privacy.attack import KNOWLEDGES, TARGETS, AttackSettings, attack_cell

PROG = "fedhet attack"
#: The keys of ``--config`` (and the flags of the same names).
SETTING_KEYS = ("target", "steps", "images", "lr", "tv_weight")


def build_parser() -> CommandParser:
    """The ``fedhet attack`` parser (a usage error is one :class:`ConfigError` line)."""
    parser = CommandParser(
        prog=PROG,
        description="Run the gradient-inversion attack of FedMD-CG's Table 2 on one method's upload (or score "
        "one gradient-free reference row) at one seed, into a run directory fedhet bench reads.",
    )
    parser.add_argument("--config", default=None, metavar="FILE",
                        help=f"a YAML mapping of settings ({', '.join(SETTING_KEYS)}); flags override it")
    parser.add_argument("--target", default=None, help=f"what is attacked: {', '.join(TARGETS)}")
    parser.add_argument("--steps", type=int, default=None, help="Adam steps of the attack per digit (default 500)")
    parser.add_argument("--images", type=int, default=None, help="digits attacked at this seed (default 1)")
    parser.add_argument("--lr", type=float, default=None, help="Adam learning rate on the dummy image (default 0.1)")
    parser.add_argument("--tv_weight", type=float, default=None, help="weight of the TV prior (default 0.01)")
    parser.add_argument("--seed", type=int, default=0, help="fixes the digits and every network (default 0)")
    parser.add_argument("--run_dir", default=None, metavar="DIR",
                        help="a new or empty directory (default runs/attack-<target>-<time>-s<seed>)")
    return parser  # fmt: skip


def parse_attack(args: Sequence[str]) -> tuple[AttackSettings, int, str | None]:
    """The settings, seed and run directory of ``fedhet attack args``; a bad one is one ConfigError line."""
    import yaml

    options = build_parser().parse_args(list(args))
    values: dict[str, Any] = {}
    if options.config is not None:
        try:
            loaded = yaml.safe_load(Path(options.config).read_text())
        except OSError:
            raise ConfigError(f"--config {options.config}: no such file") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"--config {options.config}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"--config {options.config}: write a mapping of {', '.join(SETTING_KEYS)}")
        unknown = sorted(set(loaded) - set(SETTING_KEYS))
        if unknown:
            raise ConfigError(f"--config {options.config}: unknown key '{unknown[0]}'; known keys: "
                              f"{', '.join(SETTING_KEYS)}")  # fmt: skip
        values.update(loaded)
    values.update({k: getattr(options, k) for k in SETTING_KEYS if getattr(options, k) is not None})
    if "target" not in values:
        raise ConfigError(f"give the attacked method or reference row: --target NAME, one of {', '.join(TARGETS)}")
    settings = AttackSettings(**values)
    try:
        settings.check()
    except ValueError as exc:
        raise ConfigError(f"--{exc}") from None
    return settings, options.seed, options.run_dir


def run_attack(args: Sequence[str]) -> dict[str, Any]:
    """Run ``fedhet attack args`` and write its run directory; returns the summary (with ``run_dir``)."""
    import yaml

    from fedhet.tracking.rundir import RunDirectory, default_run_path, run_environment

    settings, seed, run_dir = parse_attack(args)
    explicit = run_dir is not None
    if explicit:
        RunDirectory(run_dir).check_available()  # before any work, as fedhet fit
    path = run_dir if explicit else default_run_path(f"attack-{settings.target}", seed)
    directory = RunDirectory.claim(path, unique=not explicit)
    try:
        resolved = {"command": "attack", **settings.as_dict(), "seed": seed, "run_dir": str(directory.path)}
        directory.create(yaml.safe_dump(resolved, sort_keys=False))
        started = time.perf_counter()
        digits = attack_cell(settings, seed)
        wall_s = time.perf_counter() - started
        for number, entry in enumerate(digits):
            directory.append_metrics({"digit": number, **entry})
        keys = [f"{kind}_{knowledge}" for kind in ("psnr", "matching_loss") for knowledge in KNOWLEDGES]
        final = {key: round(sum(d[key] for d in digits) / len(digits), 4) for key in keys if key in digits[0]}
        summary = {
            "command": "attack", "method": settings.target, "scenario_kind": "attack", "seed": seed,
            "settings": settings.as_dict(), "final": final, "digits": digits, "wall_s": round(wall_s, 3),
            "environment": run_environment(),
        }  # fmt: skip
        directory.write_summary(summary)
    except BaseException as exc:
        # An attack keeps no checkpoint, so what it wrote before failing serves no rerun, and would
        # make the same command refuse the directory as not empty: it goes (the directory too, if
        # this attack made it), and the same command can simply run again.
        for written in (directory.metrics_path, directory.config_path):
            written.unlink(missing_ok=True)
        directory.release()
        if isinstance(exc, KeyboardInterrupt):
            exc.next_step = "rerun the same command (an attack keeps no checkpoint)"  # type: ignore[attr-defined]
        raise
    directory.unlock()
    return {**summary, "run_dir": str(directory.path)}


def attack_command(args: Sequence[str]) -> str:
    """``fedhet attack``: run the cell and return the lines to print (or the help)."""
    if any(arg in ("-h", "--help") for arg in args):
        return build_parser().format_help().rstrip()
    summary = run_attack(args)
    final = summary["final"]
    shown = ", ".join(f"{knowledge.replace('_', ' ')} {final[f'psnr_{knowledge}']:.2f} dB" for knowledge in KNOWLEDGES)
    count = len(summary["digits"])
    return "\n".join([
        f"attack on {summary['method']}, seed {summary['seed']}, {count} digit{'s' * (count != 1)}: PSNR {shown} "
        f"({summary['wall_s']:.1f} s)",
        f"results: {summary['run_dir']}/summary.json",
    ])  # fmt: skip


__all__ = ["attack_command", "build_parser", "parse_attack", "run_attack"]
