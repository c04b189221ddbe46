"""``benchmarks/device_wheels.py``: what travels to a lent GPU machine, checked without a registry or a GPU.

The download itself needs a package registry (run by hand before a device call, measured in
docs/performance.md); the choices around it are checked here: which wheels are carried, that a
slimmed wheel still installs with pip and lists only what it holds, the size limit, the folder
git must ignore, and the one-line refusals.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def device_wheels(monkeypatch):
    """The script as a module."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import device_wheels

    return device_wheels


def fake_wheel(folder: Path, name: str = "ray", files: dict[str, bytes] | None = None) -> Path:
    """A minimal valid wheel of ``name`` 1.0 holding ``files`` (and its METADATA, WHEEL and RECORD)."""
    files = files or {f"{name}/__init__.py": b"VALUE = 1\n", f"{name}/jars/big.jar": b"\0" * 5000,
                      f"{name}/core/gcs_server": b"#!/bin/sh\necho gcs\n" * 200}
    info = f"{name}-1.0.dist-info"
    files = {**files, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{path},,\n" for path in files) + f"{info}/RECORD,,\n"
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        for member, data in files.items():
            entry = zipfile.ZipInfo(member, (2026, 1, 1, 0, 0, 0))
            entry.external_attr = (0o755 if member.endswith("gcs_server") else 0o644) << 16
            wheel.writestr(entry, data)
        wheel.writestr(f"{info}/RECORD", record)
    return path


def test_only_the_distributions_the_device_image_lacks_are_carried(device_wheels):
    """Names are compared PEP 503-normalised; the image's own distributions and non-wheels stay behind."""
    names = ["PyYAML-6.0.4-cp312-cp312-manylinux_2_17_x86_64.whl", "typing_extensions-4.15.0-py3-none-any.whl",
             "jsonargparse-4.53.0-py3-none-any.whl", "ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl",
             "Lightning_Utilities-0.15.0-py3-none-any.whl", "mlxtend-0.25.0-py3-none-any.whl", "notes.txt"]
    assert device_wheels.distribution("PyYAML-6.0.4-cp312-cp312-manylinux_2_17_x86_64.whl") == "pyyaml"
    assert device_wheels.distribution("Lightning_Utilities-0.15.0-py3-none-any.whl") == "lightning-utilities"
    assert device_wheels.carried(names) == ["jsonargparse-4.53.0-py3-none-any.whl", "mlxtend-0.25.0-py3-none-any.whl",
                                            "ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl"]
    # the image's PyTorch stack never travels
    assert {"torch", "torchvision", "lightning", "torchmetrics", "numpy"} <= device_wheels.DEVICE_IMAGE


def test_a_slimmed_wheel_drops_the_stripped_folders_from_its_files_and_record_and_still_installs(
        device_wheels, tmp_path):
    """Ray's jars leave the files and RECORD, the binaries stay executable, and pip installs the result."""
    source = fake_wheel(tmp_path)
    slimmed = device_wheels.slim(source, tmp_path / "out.whl", device_wheels.STRIPPED["ray"])
    assert slimmed.dropped == 1 and slimmed.after < slimmed.before
    with zipfile.ZipFile(tmp_path / "out.whl") as wheel:
        names = wheel.namelist()
        assert "ray/jars/big.jar" not in names and "ray/__init__.py" in names
        assert all(info.compress_type == zipfile.ZIP_LZMA for info in wheel.infolist())
        assert "ray/jars" not in wheel.read("ray-1.0.dist-info/RECORD").decode()
        assert (wheel.getinfo("ray/core/gcs_server").external_attr >> 16) & 0o111  # still executable
    installed = tmp_path / "site"
    target = tmp_path / "ray-1.0-py3-none-any.whl"
    source.unlink()
    (tmp_path / "out.whl").rename(target)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", str(installed), str(target)], check=True, capture_output=True)
    assert (installed / "ray" / "__init__.py").read_text() == "VALUE = 1\n"
    assert not (installed / "ray" / "jars").exists()


def test_a_wheel_lzma_would_not_shrink_is_copied_as_it_is(device_wheels, tmp_path):
    """Small pure-Python wheels are carried byte for byte (LZMA's headers would make them larger)."""
    source = fake_wheel(tmp_path, "tiny", {"tiny/__init__.py": b"x = 1\n"})
    slimmed = device_wheels.slim(source, tmp_path / "copy.whl")
    assert slimmed.dropped == 0
    assert (tmp_path / "copy.whl").read_bytes() == source.read_bytes()  # LZMA's headers outweigh 6 bytes


def test_the_travel_limit_and_a_missing_package_are_one_line_refusals(device_wheels):
    """Over 64 MiB, or a requirement not installed here (its version unknown): a message naming the fix."""
    mib = 1024 * 1024
    device_wheels.check_travel(20 * mib, 40 * mib)  # 60 of 64: fine
    with pytest.raises(device_wheels.WheelError, match=r"tree \(30.0 MiB\) and the wheels \(40.0 MiB\) exceed the 64"):
        device_wheels.check_travel(30 * mib, 40 * mib)
    with pytest.raises(device_wheels.WheelError, match="not-a-package is not installed here"):
        device_wheels.pinned(["not-a-package[extra]"])
    assert device_wheels.pinned(["jsonargparse[signatures]"])[0].startswith("jsonargparse[signatures]==")


def test_the_folder_is_ignored_once_so_that_it_travels_only_when_carried(device_wheels, tmp_path):
    """``.git/info/exclude`` gets the folder once, and the measured tree leaves it out."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    assert device_wheels.ignore_folder(tmp_path, ".whl") is True
    assert device_wheels.ignore_folder(tmp_path, ".whl") is False
    assert (tmp_path / ".git" / "info" / "exclude").read_text().count("/.whl/") == 1
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "a.whl").write_bytes(b"x")
    (tmp_path / "kept.py").write_text("x = 1\n")
    assert device_wheels.tree_bytes(tmp_path) == len("x = 1\n")
