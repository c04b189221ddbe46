r"""Build ``.whl/``: the packages fedhet needs that a lent GPU machine lacks, small enough to travel.

A lent GPU machine (the ``device`` tool's ``nvidia-h200``) reaches no package registry, and its
image holds torch, Lightning, torchmetrics, numpy, scikit-learn and the rest of the scientific stack
but not jsonargparse, W&B, mlxtend, Optuna or Ray. What it lacks travels as wheels inside the
working tree, which may hold 64 MiB in all (fedhet's own files about 20). This script, run here in
the repository root where pip reaches the registries, builds that folder in one step:

1. downloads, for the device's Python (CPython 3.12, manylinux x86-64), the wheels of
   :data:`CARRIED` **at the versions installed here** (what CI tests) with everything they need;
2. keeps the wheels of the distributions the device image does not hold (:data:`DEVICE_IMAGE`);
3. strips what fedhet never imports from the two big ones (:data:`STRIPPED`: Ray's Java jars,
   dashboard front end, RLlib, Serve, Data and LLM libraries; W&B's Go binaries), drops them from
   the wheel's ``RECORD`` and rewrites the wheels with LZMA where that makes them smaller (pip
   unpacks with ``zipfile``);
4. checks the tree plus the wheels against the 64 MiB limit and replaces ``.whl/`` atomically.

Then every device call names ``.whl`` in ``carry`` and begins::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit;

``python benchmarks/device_wheels.py --no-ray`` leaves Ray out (its executor's checks then fail
with a one-line message; everything else runs).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: What fedhet needs beyond the device image's PyTorch stack: its install requirements that the
#: image lacks, and Ray for ``federation.executor: ray`` (``[ray]`` extra).
CARRIED = ("jsonargparse[signatures]", "wandb", "mlxtend", "optuna")
RAY = "ray"
#: The device's interpreter and platforms (pip matches ``manylinux_2_N`` exactly, so every N is named).
DEVICE_PYTHON = "3.12"
DEVICE_PLATFORMS = ("manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64",
                    *(f"manylinux_2_{n}_x86_64" for n in range(5, 40)))
#: The travelling working tree's limit (the device tool's README, "Limits").
TRAVEL_LIMIT_MIB = 64.0
MIB = 1024 * 1024
#: Distributions the device image ('cuda') holds, as the device library's KINDS.md lists them
#: (read 2026-11-17); their wheels are not carried: the image's copies serve.
DEVICE_IMAGE = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio interface-meta iniconfig jax jax-cuda13-pjrt
jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())
#: Folders of a carried wheel that fedhet never imports, by distribution (Ray's executor runs on
#: Ray Core alone; W&B logs offline through its Python code).
STRIPPED = {
    "ray": ("ray/jars/", "ray/dashboard/client/", "ray/rllib/", "ray/llm/", "ray/serve/", "ray/data/"),
    "wandb": ("wandb/bin/",),
}


class WheelError(RuntimeError):
    """A problem the user fixes (printed as one line)."""


def distribution(filename: str) -> str:
    """The normalised distribution name of a wheel file (``PyYAML-6.0-...whl`` -> ``pyyaml``; PEP 503)."""
    return re.sub(r"[-_.]+", "-", filename.split("-", 1)[0]).lower()


def carried(filenames: Iterable[str], image: frozenset[str] = DEVICE_IMAGE) -> list[str]:
    """The wheels of distributions the device image lacks, sorted."""
    return sorted(name for name in filenames if name.endswith(".whl") and distribution(name) not in image)


def pinned(requirements: Sequence[str]) -> list[str]:
    """``name[extras]==version`` at the version installed here, for every requirement."""
    pins = []
    for requirement in requirements:
        name = requirement.split("[", 1)[0]
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            fix = 'pip install -e ".[ray]", or pass --no-ray' if name == RAY else 'pip install -e ".[dev]"'
            raise WheelError(f"{name} is not installed here, so its version is unknown: {fix}") from None
        pins.append(f"{requirement}=={version}")
    return pins


@dataclass(frozen=True)
class Slimmed:
    """One carried wheel: its file name, its size before and after, and how many files were left out."""

    name: str
    before: int
    after: int
    dropped: int


def slim(source: Path, target: Path, strip: Sequence[str] = ()) -> Slimmed:
    """Copy the wheel ``source`` to ``target`` without the entries under ``strip``, LZMA-compressed.

    The dropped files leave ``RECORD`` too, so the installed distribution lists only what it has.
    A wheel that LZMA does not make smaller (small pure-Python ones) is copied as it is.
    """
    dropped, prefixes = 0, tuple(strip)
    with zipfile.ZipFile(source) as wheel, zipfile.ZipFile(target, "w", zipfile.ZIP_LZMA) as out:
        for info in wheel.infolist():
            if info.filename.startswith(prefixes):
                dropped += 1
                continue
            data = wheel.read(info)
            if info.filename.endswith(".dist-info/RECORD") and strip:
                lines = [line for line in data.decode().splitlines()
                         if line and not line.split(",", 1)[0].startswith(prefixes)]
                data = ("\n".join(lines) + "\n").encode()
            entry = zipfile.ZipInfo(info.filename, info.date_time)
            entry.external_attr = info.external_attr  # keeps the executable bit of Ray's binaries
            out.writestr(entry, data, zipfile.ZIP_LZMA)
    if not dropped and target.stat().st_size >= source.stat().st_size:
        shutil.copyfile(source, target)
    return Slimmed(source.name, source.stat().st_size, target.stat().st_size, dropped)


def tree_bytes(repo: Path) -> int:
    """Bytes of the working tree that travels: tracked files and untracked ones git does not ignore."""
    listing = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=repo, capture_output=True, check=True).stdout
    return sum((repo / name).stat().st_size for name in listing.decode().split("\0")
               if name and (repo / name).is_file())


def check_travel(tree: int, wheels: int, limit_mib: float = TRAVEL_LIMIT_MIB) -> None:
    """Refuse (one line) when the tree and the wheels exceed what a device call carries."""
    if tree + wheels > limit_mib * MIB:
        raise WheelError(f"the tree ({tree / MIB:.1f} MiB) and the wheels ({wheels / MIB:.1f} MiB) exceed the "
                         f"{limit_mib:.0f} MiB a device call carries: pass --no-ray, or move large untracked "
                         "files out of the checkout")


def ignore_folder(repo: Path, folder: str) -> bool:
    """Make git ignore ``folder`` (``.git/info/exclude``) so it travels only when ``carry`` names it; True if added."""
    probe = subprocess.run(["git", "check-ignore", "-q", f"{folder}/probe.whl"], cwd=repo)
    if probe.returncode == 0:
        return False
    exclude = Path(subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"], cwd=repo,
                                  capture_output=True, text=True, check=True).stdout.strip())
    exclude = exclude if exclude.is_absolute() else repo / exclude
    exclude.parent.mkdir(parents=True, exist_ok=True)
    with exclude.open("a") as file:
        file.write(f"/{folder}/\n")
    return True


def download(pins: Sequence[str], into: Path) -> None:
    """``pip download`` the pins and everything they need, as wheels for the device's Python and platform."""
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--implementation", "cp",
               "--python-version", DEVICE_PYTHON, "--dest", str(into)]
    for tag in DEVICE_PLATFORMS:
        command += ["--platform", tag]
    done = subprocess.run([*command, *pins], capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise WheelError(f"pip download failed ({last}); pip must reach a package registry from here")


def build(out: Path, requirements: Sequence[str], repo: Path = REPO) -> tuple[list[Slimmed], int]:
    """Download, select and slim the wheels into ``out`` (replaced atomically); the wheels and the tree's bytes."""
    pins = pinned(requirements)
    out = out if out.is_absolute() else repo / out
    with tempfile.TemporaryDirectory(prefix="device_wheels-") as scratch:  # outside the tree it measures
        downloads, staged = Path(scratch) / "downloads", Path(scratch) / "staged"
        downloads.mkdir()
        staged.mkdir()
        download(pins, downloads)
        slimmed = [slim(downloads / name, staged / name, STRIPPED.get(distribution(name), ()))
                   for name in carried(path.name for path in downloads.iterdir())]
        tree = tree_bytes(repo)
        check_travel(tree, sum(item.after for item in slimmed))
        incoming, previous = out.with_name(f".{out.name}-incoming"), out.with_name(f".{out.name}-previous")
        shutil.rmtree(incoming, ignore_errors=True)
        shutil.copytree(staged, incoming)  # across file systems, then two renames on this one
        if out.exists():
            out.rename(previous)
        incoming.rename(out)
        shutil.rmtree(previous, ignore_errors=True)
    return slimmed, tree


def main(argv: Sequence[str] | None = None) -> int:
    """Build the folder and print each carried wheel's size; 1 with a one-line reason on a refusal."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(".whl"), help="the folder to (re)build (default .whl)")
    parser.add_argument("--no-ray", action="store_true", help="leave Ray out (about 30 MiB)")
    args = parser.parse_args(argv)
    requirements = CARRIED if args.no_ray else (*CARRIED, RAY)
    if ignore_folder(REPO, args.out.name):
        print(f"added /{args.out.name}/ to .git/info/exclude (it travels only when a call's carry names it)")
    try:
        slimmed, tree = build(args.out, requirements)
    except WheelError as error:
        print(f"device_wheels: {error}", file=sys.stderr)
        return 1
    for item in slimmed:
        note = f", {item.dropped} files left out" if item.dropped else ""
        print(f"{item.name:70s} {item.before / MIB:7.2f} -> {item.after / MIB:6.2f} MiB{note}")
    total = sum(item.after for item in slimmed)
    print(f"{len(slimmed)} wheels, {total / MIB:.1f} MiB; with the tree's {tree / MIB:.1f} MiB: "
          f"{(total + tree) / MIB:.1f} of {TRAVEL_LIMIT_MIB:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
