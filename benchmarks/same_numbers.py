r"""Same numbers before and after a refactor: every label-skew digits config, 2 rounds, compared bit for bit.

For every config in ``configs/experiments/digits_dir/*.yaml`` (sorted), runs::

    fedhet fit --config C --rounds 2 --seed 5 --run_dir <tmp>/<name> --wandb.mode disabled --trainer.accelerator cpu

in this process (``fedhet.cli.fit``, one fresh run directory per config, one thread) and keeps,
per config, ``summary["final"]`` (every key: headline accuracies, per-client accuracies, train
losses), ``summary["comm"]["bytes_up"]`` / ``["bytes_down"]``, the wall time and the CPU time
(this process plus children; steadier than wall time on a shared machine).

* ``--record OUT.json`` writes those numbers (plus the tree, torch version, settings and the
  sha256 of any generator artifact used) to ``OUT.json``.
* ``--compare REF.json`` runs the configs of ``REF.json`` again with REF's settings and prints,
  per config, whether the final metrics are exactly equal (and their largest absolute
  difference), whether the byte counts are equal, wall and CPU times, and a one-line verdict.
  Exit status 0 when everything is equal, 1 otherwise. Metric keys missing from the new run are
  a mismatch; keys only the new run has are listed (a mismatch with ``--strict_keys``).

Which tree is measured: whichever ``fedhet`` Python imports. The old tree is run with
``PYTHONPATH=/work/wt-base``; the configs are read from that tree too (``--folder`` defaults to
``<tree>/configs/experiments/digits_dir``).

Determinism: the environment is pinned before torch loads (``OMP_NUM_THREADS=1``,
``MKL_NUM_THREADS=1``, ``MKL_DYNAMIC=FALSE``, ``WANDB_MODE=disabled``) and
``torch.set_num_threads(1)``; every run builds its own scenario, models and loop, and fedhet seeds
all randomness from ``--seed``. ``--isolation subprocess`` runs each config as
``python -m fedhet fit ...`` in a fresh interpreter instead (slower, fully isolated).

FedKTL's generator: ``fedktl.yaml`` loads the pretrained artifact ``embedded-stylegan``. The
script finds every config whose ``method.init_args.generator`` names an artifact (not
``untrained`` or a ``prefix:path`` source) and, before any run, builds that artifact in the cache
directory with ``fedhet.generators.pretrain_generator(name, steps=--generator_steps (default 20),
seed=0, image_size=32, progress=False)`` -- exactly ``fedhet pretrain-generator --steps 20``,
i.e. the shipped recipe cut from 1,500 to 20 steps (3 s on one core instead of ~25 min).
An artifact already there with the same settings is reused as is (that is fedhet's own rule), so
before and after runs that share ``--cache_dir`` load byte-identical weights; the sha256 is
recorded and ``--compare`` checks it. The generator is nearly untrained: these runs check
numerical identity, not FedKTL's accuracy. Pretraining code is outside the refactor's scope;
if it changed, the sha256 check says so.

The cache directory (``--cache_dir``, default ``$FEDHET_CACHE`` or
``~/.cache/fedhet-same-numbers``) is exported as ``FEDHET_CACHE`` and also holds the embedded data
cache, so all runs read the same ``.npz``. Keep it separate from a cache holding the real
1,500-step generator: fedhet refuses to overwrite an artifact built with other settings.

Usage (old tree, then new tree)::

    cd /work/wt-base && PYTHONPATH=/work/wt-base python /work/main/benchmarks/same_numbers.py \
        --record /work/main/benchmarks/notes/same_numbers_before.json
    cd /work/main && python benchmarks/same_numbers.py --compare benchmarks/notes/same_numbers_before.json

Options: ``--configs fedavg fedktl`` (names, files or globs; default all), ``--folder DIR``,
``--rounds 2``, ``--seed 5``, ``--generator_steps 20``, ``--keep_runs DIR`` (keep run directories).
"""

from __future__ import annotations

import os

# Pin threads before torch (and MKL) load: identical reductions on a busy 2-core machine.
for _key, _value in (
    ("OMP_NUM_THREADS", "1"),
    ("MKL_NUM_THREADS", "1"),
    ("MKL_DYNAMIC", "FALSE"),
    ("WANDB_MODE", "disabled"),
):
    os.environ[_key] = _value

import argparse  # noqa: E402
import glob  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import yaml  # noqa: E402

FORMAT = 1
DEFAULT_CACHE = "~/.cache/fedhet-same-numbers"
GENERATOR_SEED = 0
GENERATOR_IMAGE_SIZE = 32


# --------------------------------------------------------------------------------------------
# Environment and inputs
# --------------------------------------------------------------------------------------------


def tree_root() -> Path:
    """Root of the fedhet source tree Python imports (the tree being measured)."""
    import fedhet

    return Path(fedhet.__file__).resolve().parents[1]


def git_commit(root: Path) -> str | None:
    """``git rev-parse HEAD`` of ``root`` plus ``+dirty`` when fedhet/ has uncommitted changes."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", "fedhet", "configs"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def select_configs(folder: Path, patterns: list[str] | None) -> list[Path]:
    """Sorted config files: all ``folder/*.yaml``, or those named by ``patterns``.

    A pattern is a config name (``fedavg``), a file path, or a glob (relative to ``folder`` first,
    then to the working directory).
    """
    if not patterns:
        found = sorted(folder.glob("*.yaml"))
    else:
        chosen: set[Path] = set()
        for pattern in patterns:
            if not any(ch in pattern for ch in "*?[") and not pattern.endswith((".yaml", ".yml")):
                pattern = f"{pattern}.yaml"
            matches = glob.glob(str(folder / pattern)) or glob.glob(pattern)
            if not matches:
                raise SystemExit(f"same_numbers: no config matches {pattern!r} (folder {folder})")
            chosen.update(Path(m).resolve() for m in matches)
        found = sorted(chosen, key=lambda p: (p.name, str(p)))
    if not found:
        raise SystemExit(f"same_numbers: no *.yaml configs in {folder}")
    names = [p.stem for p in found]
    if len(set(names)) != len(names):
        raise SystemExit(f"same_numbers: configs share a name: {names}")
    return found


def generator_artifacts(configs: list[Path]) -> list[str]:
    """Names of pretrained generator artifacts the configs load (``method.init_args.generator``)."""
    names = set()
    for path in configs:
        config = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        init_args = (config.get("method") or {}).get("init_args") or {}
        name = init_args.get("generator")
        if isinstance(name, str) and name != "untrained" and ":" not in name:
            names.add(name)
    return sorted(names)


def sha256(path: Path) -> str:
    """Hex sha256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def prepare_generators(names: list[str], cache_dir: Path, steps: int) -> dict[str, dict[str, Any]]:
    """Build (or reuse, if identical settings) each artifact in ``cache_dir``; return settings and sha256."""
    from fedhet.generators import pretrain_generator

    built: dict[str, dict[str, Any]] = {}
    for name in names:
        started = time.perf_counter()
        weights = pretrain_generator(
            name, steps=steps, seed=GENERATOR_SEED, image_size=GENERATOR_IMAGE_SIZE, cache_dir=cache_dir, progress=False
        )
        built[name] = {
            "steps": steps,
            "seed": GENERATOR_SEED,
            "image_size": GENERATOR_IMAGE_SIZE,
            "weights": str(weights),
            "sha256": sha256(weights),
            "prepare_s": round(time.perf_counter() - started, 1),
        }
        print(
            f"generator {name}: {weights} sha256 {built[name]['sha256'][:16]}... ({built[name]['prepare_s']} s)",
            flush=True,
        )
    return built


# --------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------


def fit_args(config: Path, rounds: int, seed: int, run_dir: Path, accelerator: str) -> list[str]:
    """The ``fedhet fit`` arguments of one run."""
    return [
        "--config", str(config),
        "--rounds", str(rounds),
        "--seed", str(seed),
        "--run_dir", str(run_dir),
        "--wandb.mode", "disabled",
        "--trainer.accelerator", accelerator,
    ]  # fmt: skip


def run_one(config: Path, rounds: int, seed: int, run_dir: Path, accelerator: str, isolation: str) -> dict[str, Any]:
    """Run one config; return its final metrics, byte counts, wall and CPU times."""
    import resource

    args = fit_args(config, rounds, seed, run_dir, accelerator)
    started, cpu_started = time.perf_counter(), time.process_time()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    children_started = children.ru_utime + children.ru_stime
    if isolation == "inprocess":
        import torch

        from fedhet.cli import fit

        torch.set_num_threads(1)
        summary = fit(args)
    else:
        command = [sys.executable, "-c", "import torch, sys; torch.set_num_threads(1); "
                   "from fedhet.cli import main; sys.exit(main(sys.argv[1:]))", "fit", *args]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
        if done.returncode != 0:
            raise RuntimeError(f"{config.name}: fedhet fit exited {done.returncode}:\n{done.stderr[-4000:]}")
        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    wall_s = time.perf_counter() - started
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = time.process_time() - cpu_started + children.ru_utime + children.ru_stime - children_started
    return {
        "config": str(config),
        "method": summary.get("method"),
        "final": summary["final"],
        "comm": {"bytes_up": summary["comm"]["bytes_up"], "bytes_down": summary["comm"]["bytes_down"]},
        "wall_s": round(wall_s, 3),
        "cpu_s": round(cpu_s, 3),
        "loop_wall_s": summary.get("wall_s"),
    }


def run_all(configs: list[Path], settings: dict[str, Any], keep_runs: Path | None) -> dict[str, dict[str, Any]]:
    """Run every config once, each in a fresh run directory under a temporary (or kept) root."""
    root = keep_runs if keep_runs is not None else Path(tempfile.mkdtemp(prefix="same-numbers-"))
    root.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    try:
        for index, config in enumerate(configs, 1):
            run_dir = root / config.stem
            if run_dir.exists():
                shutil.rmtree(run_dir)
            print(f"[{index}/{len(configs)}] {config.stem} ...", end=" ", flush=True)
            result = run_one(
                config, settings["rounds"], settings["seed"], run_dir, settings["accelerator"], settings["isolation"]
            )
            results[config.stem] = result
            print(f"{result['wall_s']:.1f} s wall, {result['cpu_s']:.1f} s CPU", flush=True)
    finally:
        if keep_runs is None:
            shutil.rmtree(root, ignore_errors=True)
    return results


# --------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------


def _equal(a: Any, b: Any) -> bool:
    """Exact equality; two NaNs are equal (a NaN metric that stays NaN is reproduced)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


def compare_final(ref: dict[str, Any], new: dict[str, Any]) -> tuple[list[str], list[str], list[str], float]:
    """Keys that differ, keys missing from ``new``, keys only in ``new``, largest absolute difference."""
    differing, max_diff = [], 0.0
    for key in sorted(set(ref) & set(new)):
        a, b = ref[key], new[key]
        if not _equal(a, b):
            differing.append(key)
            if isinstance(a, (int, float)) and isinstance(b, (int, float)):
                max_diff = max(max_diff, abs(float(a) - float(b)) if not (math.isnan(a) or math.isnan(b)) else math.inf)
            else:
                max_diff = math.inf
    return differing, sorted(set(ref) - set(new)), sorted(set(new) - set(ref)), max_diff


def report(reference: dict[str, Any], current: dict[str, Any], strict_keys: bool) -> bool:
    """Print the per-config comparison table and the verdict; return whether everything matched."""
    ok = True
    lines = [
        "| config | final metrics | max abs diff | bytes up/down | wall ref s | wall now s | CPU ref s | CPU now s |"
        " CPU now/ref |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    notes = []
    for name, ref in reference["runs"].items():
        new = current["runs"].get(name)
        if new is None:
            lines.append(f"| {name} | NOT RUN | | | {ref['wall_s']:.1f} | | | | |")
            ok = False
            continue
        differing, missing, extra, max_diff = compare_final(ref["final"], new["final"])
        metrics_ok = not differing and not missing and not (strict_keys and extra)
        bytes_ok = ref["comm"] == new["comm"]
        ok &= metrics_ok and bytes_ok
        cell = "equal" if metrics_ok else f"DIFFER ({len(differing)} of {len(ref['final'])} keys)"
        if missing:
            cell += f", {len(missing)} missing"
        byte_cell = (
            "equal"
            if bytes_ok
            else (
                f"DIFFER (up {ref['comm']['bytes_up']}->{new['comm']['bytes_up']}, "
                f"down {ref['comm']['bytes_down']}->{new['comm']['bytes_down']})"
            )
        )
        cpu_ref, cpu_new = ref.get("cpu_s", math.nan), new.get("cpu_s", math.nan)
        ratio = cpu_new / cpu_ref if cpu_ref else math.nan
        lines.append(
            f"| {name} | {cell} | {max_diff:.3g} | {byte_cell} | "
            f"{ref['wall_s']:.1f} | {new['wall_s']:.1f} | {cpu_ref:.1f} | {cpu_new:.1f} | {ratio:.2f} |"
        )
        if differing:
            shown = ", ".join(f"{k}: {ref['final'][k]!r} -> {new['final'][k]!r}" for k in differing[:5])
            notes.append(f"{name}: differing keys (first 5): {shown}")
        if missing:
            notes.append(f"{name}: keys missing in the new run: {', '.join(missing[:10])}")
        if extra:
            notes.append(
                f"{name}: keys only in the new run{' (strict: mismatch)' if strict_keys else ''}: "
                f"{', '.join(extra[:10])}"
            )
    for name, ref_gen in reference["meta"].get("generators", {}).items():
        new_gen = current["meta"].get("generators", {}).get(name)
        if new_gen is None or new_gen["sha256"] != ref_gen["sha256"]:
            ok = False
            notes.append(
                f"generator {name}: sha256 differs from the reference ({ref_gen['sha256'][:16]}... vs "
                f"{(new_gen or {}).get('sha256', 'none')[:16]}...): runs did not load the same weights"
            )
    print("\n".join(lines))
    for note in notes:
        print("- " + note)
    total_ref = sum(r["wall_s"] for r in reference["runs"].values())
    total_new = sum(r["wall_s"] for r in current["runs"].values())
    cpu_ref = sum(r.get("cpu_s", math.nan) for r in reference["runs"].values())
    cpu_new = sum(r.get("cpu_s", math.nan) for r in current["runs"].values())
    print(
        f"\nreference: {reference['meta'].get('tree')} @ {reference['meta'].get('commit')}; "
        f"now: {current['meta'].get('tree')} @ {current['meta'].get('commit')}"
    )
    print(
        f"total wall: reference {total_ref:.1f} s, now {total_new:.1f} s; total CPU: reference {cpu_ref:.1f} s, "
        f"now {cpu_new:.1f} s (CPU time is the steadier measure on a shared machine)"
    )
    compared = len(reference["runs"])
    if ok:
        print(f"VERDICT: SAME NUMBERS -- all {compared} configs reproduce final metrics and byte counts exactly")
    else:
        print(
            f"VERDICT: DIFFERENT -- at least one of {compared} configs does not reproduce "
            "the reference exactly (see above)"
        )
    return ok


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def measure(configs: list[Path], settings: dict[str, Any], cache_dir: Path, keep_runs: Path | None) -> dict[str, Any]:
    """Prepare generators, run every config, and return the record (meta + runs)."""
    import torch

    torch.set_num_threads(1)
    root = tree_root()
    print(
        f"fedhet tree: {root} ({git_commit(root)}); cache: {cache_dir}; {len(configs)} configs; "
        f"rounds {settings['rounds']}, seed {settings['seed']}, {settings['isolation']}",
        flush=True,
    )
    generators = prepare_generators(generator_artifacts(configs), cache_dir, settings["generator_steps"])
    runs = run_all(configs, settings, keep_runs)
    meta = {
        "format": FORMAT,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "tree": str(root),
        "commit": git_commit(root),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cache_dir": str(cache_dir),
        "settings": settings,
        "generators": generators,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }
    return {"meta": meta, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    """Record or compare; the exit status is 0 when recorded or everything matched, 1 otherwise."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", type=Path, help="run and write the numbers to this JSON file")
    mode.add_argument("--compare", type=Path, help="run again with this JSON's settings and compare")
    parser.add_argument(
        "--configs", nargs="+", default=None, help="config names, files or globs (default: all in --folder)"
    )
    parser.add_argument(
        "--folder", type=Path, default=None, help="config folder (default <fedhet tree>/configs/experiments/digits_dir)"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument(
        "--accelerator", default="cpu", help="trainer.accelerator of every run (cpu: same numbers on any machine)"
    )
    parser.add_argument(
        "--generator_steps", type=int, default=20, help="pretraining steps of generator artifacts the configs load"
    )
    parser.add_argument("--isolation", choices=("inprocess", "subprocess"), default="inprocess")
    parser.add_argument(
        "--cache_dir",
        type=Path,
        default=None,
        help=f"FEDHET_CACHE for all runs (default $FEDHET_CACHE or {DEFAULT_CACHE})",
    )
    parser.add_argument("--keep_runs", type=Path, default=None, help="keep run directories under this folder")
    parser.add_argument(
        "--strict_keys", action="store_true", help="--compare: metric keys only the new run has are a mismatch"
    )
    args = parser.parse_args(argv)

    cache_dir = (args.cache_dir or Path(os.environ.get("FEDHET_CACHE", DEFAULT_CACHE))).expanduser().resolve()
    os.environ["FEDHET_CACHE"] = str(cache_dir)
    folder = (args.folder or tree_root() / "configs" / "experiments" / "digits_dir").resolve()

    if args.record is not None:
        settings = {
            "rounds": args.rounds,
            "seed": args.seed,
            "accelerator": args.accelerator,
            "generator_steps": args.generator_steps,
            "isolation": args.isolation,
        }
        record = measure(select_configs(folder, args.configs), settings, cache_dir, args.keep_runs)
        args.record.parent.mkdir(parents=True, exist_ok=True)
        args.record.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n", encoding="utf-8")
        print(f"wrote {args.record} ({len(record['runs'])} configs)")
        return 0

    reference = json.loads(args.compare.read_text(encoding="utf-8"))
    settings = dict(reference["meta"]["settings"])
    settings["isolation"] = args.isolation
    names = list(reference["runs"])
    if args.configs:
        wanted = {p.stem for p in select_configs(folder, args.configs)}
        names = [n for n in names if n in wanted]
        reference = {**reference, "runs": {n: reference["runs"][n] for n in names}}
    configs = select_configs(folder, names)
    needed = generator_artifacts(configs)
    generators = {k: v for k, v in reference["meta"].get("generators", {}).items() if k in needed}
    reference = {**reference, "meta": {**reference["meta"], "generators": generators}}
    current = measure(configs, settings, cache_dir, args.keep_runs)
    return 0 if report(reference, current, args.strict_keys) else 1


if __name__ == "__main__":
    raise SystemExit(main())
