"""FedKTL's embedded generators: built on first use (one announcing line, progress, atomic, locked), the pool recipe.

Every build is tiny (a few steps) and goes to a temporary cache.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fedhet.errors import ConfigError
from fedhet.generators import EMBEDDED_RECIPES, POOL_GENERATOR, load_generator, pretrain_generator
from fedhet.generators import pretrain as pretrain_module
from fedhet.generators.pretrain import augment_pool_batch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def tiny_recipes(monkeypatch):
    """Both embedded recipes shrunk to 3 training steps."""
    for name, recipe in list(EMBEDDED_RECIPES.items()):
        monkeypatch.setitem(pretrain_module.EMBEDDED_RECIPES, name, replace(recipe, steps=3))
    monkeypatch.delenv("FEDHET_AUTO_PRETRAIN", raising=False)


def test_missing_embedded_generator_is_built_on_first_use_with_one_line(tmp_path, tiny_recipes, caplog):
    """A missing embedded artifact is pretrained on first use: one announcing line, progress, a timing line."""
    caplog.set_level(logging.INFO, logger="fedhet")
    generator = load_generator(POOL_GENERATOR, cache_dir=tmp_path)
    assert generator.resolution == 32 and generator.latent_dim == 128
    messages = [record.getMessage() for record in caplog.records if record.name == "fedhet"]
    announce = [m for m in messages if "is not built yet" in m]
    assert len(announce) == 1 and "\n" not in announce[0]
    assert f"'{POOL_GENERATOR}'" in announce[0] and "3 steps" in announce[0] and "about" in announce[0]
    assert f"fedhet pretrain-generator --name {POOL_GENERATOR}" in announce[0]
    assert any("step 3/3 (100%)" in m and "ETA" in m for m in messages)  # progress (no terminal: log lines)
    assert any(m.startswith(f"FedKTL generator '{POOL_GENERATOR}' built in") for m in messages)
    folder = tmp_path / "generators"
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == [
        f"{POOL_GENERATOR}.json",
        f"{POOL_GENERATOR}.png",
        f"{POOL_GENERATOR}.pt",
    ]
    assert not [p for p in folder.iterdir() if ".tmp" in p.name]  # temporary files renamed, none left
    caplog.clear()
    again = load_generator(POOL_GENERATOR, cache_dir=tmp_path)  # second use: loaded, not rebuilt
    assert not [r for r in caplog.records if "is not built yet" in r.getMessage()]
    w = generator.sample_w(2, torch.Generator().manual_seed(0))
    torch.testing.assert_close(again.synthesize(w), generator.synthesize(w), rtol=0, atol=0)


def test_first_use_can_be_disabled_and_other_sources_are_never_built(tmp_path, tiny_recipes, monkeypatch):
    """FEDHET_AUTO_PRETRAIN=0, other artifact names and user-supplied sources fail in one line, building nothing."""
    monkeypatch.setenv("FEDHET_AUTO_PRETRAIN", "0")
    with pytest.raises(ConfigError, match="FEDHET_AUTO_PRETRAIN=0; build it once with: fedhet pretrain-generator"):
        load_generator("embedded-stylegan", cache_dir=tmp_path)
    monkeypatch.delenv("FEDHET_AUTO_PRETRAIN")
    with pytest.raises(ConfigError, match="fedhet pretrain-generator --name mine"):
        load_generator("mine", cache_dir=tmp_path)
    with pytest.raises(ConfigError, match="not found"):
        load_generator(f"stylegan-pkl:{tmp_path / 'missing.pkl'}")
    with pytest.raises(ConfigError):
        load_generator(f"stable-diffusion:{tmp_path / 'missing'}")
    assert not (tmp_path / "generators").exists() or not list((tmp_path / "generators").glob("*.pt"))


_RACER = """
import sys, logging, torch
from dataclasses import replace
torch.set_num_threads(1)
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from fedhet.generators import pretrain, load_generator
recipe = pretrain.EMBEDDED_RECIPES["embedded-stylegan"]
pretrain.EMBEDDED_RECIPES["embedded-stylegan"] = replace(recipe, steps=5)
generator = load_generator("embedded-stylegan", cache_dir=sys.argv[1])
w = generator.sample_w(2, torch.Generator().manual_seed(0))
print("LOADED", float(generator.synthesize(w).double().sum()))
"""


def test_two_processes_racing_for_a_missing_generator_build_it_once(tmp_path):
    """Two processes needing the same missing generator at once: one builds, the other waits and loads it whole."""
    import fcntl

    folder = tmp_path / "generators"
    folder.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "FEDHET_AUTO_PRETRAIN": "1"}
    logs = [tmp_path / f"racer{i}.log" for i in range(2)]
    with open(folder / ".embedded-stylegan.lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # hold the build lock until both racers queue behind it
        racers = []
        for path in logs:
            with open(path, "w") as out:
                racers.append(
                    subprocess.Popen(
                        [sys.executable, "-c", _RACER, str(tmp_path)], stdout=out, stderr=subprocess.STDOUT, env=env
                    )
                )
        deadline = time.monotonic() + 240
        while not all("waiting for another process" in p.read_text() for p in logs):
            assert time.monotonic() < deadline and all(r.poll() is None for r in racers), [p.read_text() for p in logs]
            time.sleep(0.2)
        fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    assert [r.wait(timeout=240) for r in racers] == [0, 0], [p.read_text() for p in logs]
    outputs = [p.read_text() for p in logs]
    assert sum(o.count("is not built yet") for o in outputs) == 1  # built once
    loaded = [line for o in outputs for line in o.splitlines() if line.startswith("LOADED")]
    assert len(loaded) == 2 and loaded[0] == loaded[1]  # both use the same whole artifact
    meta = json.loads((folder / "embedded-stylegan.json").read_text())
    assert meta["training"]["steps"] == 5 and meta["training"]["data"] == "photos"
    assert not [p for p in folder.iterdir() if ".tmp" in p.name]


def test_pool_recipe_records_its_sources_and_never_holds_the_mnist_domain(tmp_path):
    """The pool artifact trains on UCI, MNIST-M, font digits and photos (no MNIST domain), augmented."""
    recipe = EMBEDDED_RECIPES[POOL_GENERATOR]
    assert "mnist" not in recipe.sources and recipe.augment
    assert EMBEDDED_RECIPES["embedded-stylegan"].sources == ("photos",)
    tiny = dict(steps=2, image_size=16, batch_size=4, cache_dir=tmp_path, progress=False)
    weights = pretrain_generator(POOL_GENERATOR, **tiny)
    training = json.loads(weights.with_suffix(".json").read_text())["training"]
    assert training["data"] == "uci+mnistm+syn+photos" and training["augment"] == "affine-colour-v1"
    assert load_generator(POOL_GENERATOR, cache_dir=tmp_path).resolution == 16
    with pytest.raises(ConfigError, match="unknown generator data sources"):
        pretrain_generator("bad", sources=["nope"], **tiny)


def test_pool_augmentation_is_seeded_in_range_and_changes_images():
    """The pool augmentation keeps shape and [0, 1], depends only on its generator, and changes every image."""
    images = torch.rand(6, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    first = augment_pool_batch(images, torch.Generator().manual_seed(2))
    second = augment_pool_batch(images, torch.Generator().manual_seed(2))
    assert first.shape == images.shape and first.min() >= 0 and first.max() <= 1
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    assert ((first - images).abs().flatten(1).mean(1) > 0.01).all()
    assert augment_pool_batch(images[:0], torch.Generator()).shape[0] == 0
