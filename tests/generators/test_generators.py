"""Frozen generators for FedKTL: interface, GAN losses, pretraining artifact, adapters, CLI.

Every test is tiny (16x16 images, a few training steps) and needs no network.
"""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from torch import nn

from fedhet.errors import CheckpointError, ConfigError
from fedhet.generators import GeneratorAdapter, load_generator, pretrain_generator
from fedhet.generators.stylegan import ModulatedConv2d, StyleGeneratorConfig

TINY = dict(image_size=16, batch_size=4, progress=False)


def _rng(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------------------------
# The untrained generator and the interface
# --------------------------------------------------------------------------------------------


def test_untrained_generator_shapes_range_and_frozen():
    """The untrained generator has the documented sizes, images in [-1, 1] and frozen parameters."""
    generator = load_generator("untrained")
    assert isinstance(generator, GeneratorAdapter)
    assert (generator.latent_dim, generator.resolution, generator.out_channels) == (128, 32, 3)
    w = generator.sample_w(5, _rng())
    images = generator.synthesize(w)
    assert w.shape == (5, 128) and images.shape == (5, 3, 32, 32)
    assert images.min() >= -1 and images.max() <= 1 and images.std() > 0.05  # not a constant image
    assert all(not p.requires_grad for p in generator.parameters())
    parent = nn.ModuleDict({"generator": generator}).train()
    assert not parent["generator"].training  # stays in eval mode under a parent's .train()


def test_untrained_generator_is_identical_across_loads_and_seeds_select_latents():
    """Two loads are the same generator; the latents follow the generator or global seed given."""
    first, second = load_generator("untrained"), load_generator("untrained")
    w = first.sample_w(3, _rng(7))
    torch.testing.assert_close(w, second.sample_w(3, _rng(7)), rtol=0, atol=0)
    torch.testing.assert_close(first.synthesize(w), second.synthesize(w), rtol=0, atol=0)
    assert not torch.equal(w, first.sample_w(3, _rng(8)))
    from fedhet.seeding import seeded

    with seeded(3):
        global_a = first.sample_w(2)
    with seeded(3):
        global_b = first.sample_w(2)
    torch.testing.assert_close(global_a, global_b, rtol=0, atol=0)


def test_sample_w_distribution_is_a_learned_nonlinear_image_of_gaussian_noise():
    """Sampled latents are finite, distinct per sample and spread in every coordinate."""
    generator = load_generator("untrained")
    w = generator.sample_w(512, _rng(1))
    assert w.shape == (512, generator.latent_dim) and torch.isfinite(w).all()
    # distinct latents per sample and a spread in every coordinate
    assert torch.cdist(w[:8], w[:8]).fill_diagonal_(1.0).min() > 0
    assert (w.std(dim=0) > 0).all()


def test_gradient_reaches_latents_through_the_frozen_generator():
    """Gradients reach the latents through the generator but not its frozen parameters."""
    generator = load_generator("untrained")
    w = generator.sample_w(2, _rng()).requires_grad_(True)
    generator.synthesize(w).square().mean().backward()
    assert w.grad is not None and w.grad.abs().sum() > 0
    assert all(p.grad is None for p in generator.parameters())


def test_bad_latents_are_one_line_errors():
    """Latents of the wrong size, n < 1 or a resolution that is no power of two are ConfigErrors."""
    generator = load_generator("untrained")
    with pytest.raises(ConfigError, match=r"shape \[n, 128\]"):
        generator.synthesize(torch.zeros(2, 64))
    with pytest.raises(ConfigError, match="n >= 1"):
        generator.sample_w(0)
    with pytest.raises(ConfigError, match="power of two"):
        StyleGeneratorConfig(resolution=24)


def test_modulated_convolution_equals_the_per_sample_weight_convolution():
    """The grouped modulated convolution equals StyleGAN2's per-sample modulated, demodulated weights."""
    torch.manual_seed(0)
    layer = ModulatedConv2d(2, 3, 3, w_dim=4, demodulate=True)
    x, w = torch.randn(2, 2, 5, 5), torch.randn(2, 4)
    styles = layer.affine(w)
    outputs = []
    for i in range(2):  # StyleGAN2 Eq. 1-3 written per sample: w'_ijk = s_i w_ijk / sqrt(sum (s_i w_ijk)^2)
        weight = layer.weight * layer.weight_gain * styles[i][None, :, None, None]
        weight = weight / (weight.square().sum(dim=(1, 2, 3), keepdim=True) + 1e-8).sqrt()
        outputs.append(torch.nn.functional.conv2d(x[i : i + 1], weight, layer.bias, padding=1))
    torch.testing.assert_close(layer(x, w), torch.cat(outputs), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Pretraining artifact
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny generator pretrained for 3 steps into a temporary cache (once per module)."""
    cache = tmp_path_factory.mktemp("generator-cache")
    weights = pretrain_generator("tiny", steps=3, seed=5, cache_dir=cache, **TINY)
    return cache, weights


def test_pretraining_writes_a_checksummed_artifact_that_loads_by_name(pretrained):
    """Pretraining writes weights, metadata with a SHA-256 and a preview, and the artifact loads by name."""
    cache, weights = pretrained
    meta = json.loads(weights.with_suffix(".json").read_text())
    assert meta["training"]["steps"] == 3 and meta["config"]["resolution"] == 16
    assert len(meta["sha256"]) == 64 and weights.with_suffix(".png").is_file()
    generator = load_generator("tiny", cache_dir=cache)
    state = torch.load(weights, map_location="cpu", weights_only=True)
    for key, value in generator.generator.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0)
    w = generator.sample_w(4, _rng())
    images = generator.synthesize(w)
    assert images.shape == (4, 3, 16, 16) and images.abs().max() <= 1
    again = load_generator("tiny", cache_dir=cache)
    torch.testing.assert_close(again.synthesize(again.sample_w(4, _rng())), images, rtol=0, atol=0)
    # three GAN steps moved the weights away from their initialisation
    initial = pretrain_generator("untrained-copy", steps=1, seed=5, cache_dir=cache, lr=0.0, **TINY)
    untrained = load_generator("untrained-copy", cache_dir=cache)
    assert initial.is_file()
    assert not torch.allclose(untrained.synthesize(untrained.sample_w(4, _rng())), images)


def test_pretraining_is_deterministic_and_reuses_an_identical_artifact(pretrained, tmp_path):
    """Pretraining twice with one seed gives the same checksum and reuses the existing artifact."""
    cache, weights = pretrained
    other = pretrain_generator("tiny", steps=3, seed=5, cache_dir=tmp_path, **TINY)
    sha = json.loads(weights.with_suffix(".json").read_text())["sha256"]
    assert json.loads(other.with_suffix(".json").read_text())["sha256"] == sha
    mtime = other.stat().st_mtime_ns
    assert pretrain_generator("tiny", steps=3, seed=5, cache_dir=tmp_path, **TINY) == other
    assert other.stat().st_mtime_ns == mtime  # same settings: reused, not retrained
    with pytest.raises(ConfigError, match="other settings.*--force"):
        pretrain_generator("tiny", steps=4, seed=5, cache_dir=tmp_path, **TINY)


def test_tampered_weights_fail_the_checksum(pretrained, tmp_path):
    """A changed weights file fails the checksum with a fix-it command."""
    cache, weights = pretrained
    target = tmp_path / "generators"
    target.mkdir()
    for suffix in (".pt", ".json"):
        (target / f"tiny{suffix}").write_bytes(weights.with_suffix(suffix).read_bytes())
    data = bytearray((target / "tiny.pt").read_bytes())
    data[-100] ^= 0xFF
    (target / "tiny.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256.*fedhet pretrain-generator --name tiny.*--force"):
        load_generator("tiny", cache_dir=tmp_path)


def test_missing_artifact_names_the_command_that_builds_it(tmp_path, monkeypatch):
    """A missing artifact names the pretrain command; a path-like name is refused."""
    monkeypatch.setenv("FEDHET_AUTO_PRETRAIN", "0")  # embedded names are otherwise built on first use
    disabled = f"FEDHET_AUTO_PRETRAIN=0; .*fedhet pretrain-generator --cache_dir {tmp_path}$"
    with pytest.raises(ConfigError, match=disabled):
        load_generator("embedded-stylegan", cache_dir=tmp_path)
    with pytest.raises(ConfigError, match="fedhet pretrain-generator --name mine"):
        load_generator("mine", cache_dir=tmp_path)
    with pytest.raises(ConfigError, match="cannot name an artifact"):
        load_generator("../escape", cache_dir=tmp_path)


def test_cli_pretrain_generator_prints_the_artifact_and_errors_in_one_line(tmp_path, capsys):
    """The pretrain-generator command prints the artifact; a conflict or bad argument fails in one line."""
    from fedhet.cli import main

    args = ["pretrain-generator", "--name", "cli", "--steps", "2", "--image_size", "16", "--cache_dir", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "generators" / "cli.pt") in out
    assert load_generator("cli", cache_dir=tmp_path).resolution == 16
    assert main([*args, "--steps", "3"]) == 2  # exists with other settings, no --force
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedhet: error:") and "--force" in err and "\n" not in err
    assert main([*args, "--bogus", "1"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0


# --------------------------------------------------------------------------------------------
# Stable Diffusion VAE adapter
# --------------------------------------------------------------------------------------------


def test_stable_diffusion_adapter_decodes_flattened_vae_latents(tmp_path):
    """The Stable Diffusion adapter decodes flattened VAE latents (rescaled) into images in [-1, 1]."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=16,
    )
    vae.save_pretrained(tmp_path / "sd" / "vae")
    generator = load_generator(f"stable-diffusion:{tmp_path / 'sd'}")
    assert (generator.latent_dim, generator.resolution, generator.out_channels) == (4 * 8 * 8, 16, 3)
    w = generator.sample_w(2, _rng())
    assert w.shape == (2, 256)
    images = generator.synthesize(w)
    assert images.shape == (2, 3, 16, 16) and images.abs().max() <= 1
    # the decoder sees the latent unscaled by the VAE's scaling factor (0.18215 for SD v1.5)
    expected = vae.decode(w.reshape(2, 4, 8, 8) / vae.config.scaling_factor).sample.clamp(-1, 1)
    torch.testing.assert_close(images, expected.detach())
    with pytest.raises(ConfigError, match="no Stable Diffusion VAE"):
        load_generator(f"stable-diffusion:{tmp_path / 'empty'}")


# --------------------------------------------------------------------------------------------
# StyleGAN pickle adapter
# --------------------------------------------------------------------------------------------


class FakeMapping(nn.Module):
    """``mapping(z, c) -> [n, num_ws, w_dim]`` like StyleGAN's, from a linear map of ``[z, c]``."""

    def __init__(self, z_dim: int, c_dim: int, w_dim: int, num_ws: int) -> None:
        super().__init__()
        self.linear = nn.Linear(z_dim + c_dim, w_dim)
        self.num_ws = num_ws
        self.last_c: torch.Tensor | None = None

    def forward(self, z, c, truncation_psi=1):
        self.last_c = c
        return self.linear(torch.cat([z, c], dim=1))[:, None].repeat(1, self.num_ws, 1)


class FakeSynthesis(nn.Module):
    """``synthesis(ws, noise_mode, force_fp32)``: a linear image of ``ws[:, 0]`` scaled past [-1, 1]."""

    def __init__(self, w_dim: int, num_ws: int, resolution: int) -> None:
        super().__init__()
        self.linear = nn.Linear(w_dim, 3 * resolution * resolution)
        self.num_ws = num_ws
        self.resolution = resolution
        self.calls: list[dict] = []

    def forward(self, ws, noise_mode="random", force_fp32=False):
        self.calls.append({"shape": tuple(ws.shape), "noise_mode": noise_mode, "force_fp32": force_fp32,
                           "all_equal": bool((ws == ws[:, :1]).all())})
        return 5 * self.linear(ws[:, 0]).reshape(-1, 3, self.resolution, self.resolution)


class FakeStyleGAN(nn.Module):
    """The attributes a StyleGAN2/3 ``G_ema`` exposes, nothing more."""

    def __init__(self, c_dim: int = 0) -> None:
        super().__init__()
        self.z_dim, self.c_dim, self.w_dim, self.img_resolution, self.img_channels, self.num_ws = 6, c_dim, 5, 8, 3, 4
        self.mapping = FakeMapping(self.z_dim, c_dim, self.w_dim, self.num_ws)
        self.synthesis = FakeSynthesis(self.w_dim, self.num_ws, self.img_resolution)


def _pickle(tmp_path, obj, name="network.pkl"):
    path = tmp_path / name
    with open(path, "wb") as handle:
        pickle.dump(obj, handle)
    return path


def test_stylegan_pickle_adapter_repeats_w_and_synthesizes_with_constant_noise(tmp_path):
    """The StyleGAN pickle adapter repeats w per layer and synthesises with constant noise in fp32."""
    torch.manual_seed(0)
    path = _pickle(tmp_path, {"G_ema": FakeStyleGAN(), "D": None})
    generator = load_generator(f"stylegan-pkl:{path}")
    assert (generator.latent_dim, generator.resolution, generator.out_channels) == (5, 8, 3)
    w = generator.sample_w(3, _rng())
    assert w.shape == (3, 5)
    images = generator.synthesize(w)
    assert images.shape == (3, 3, 8, 8) and images.abs().max() <= 1
    call = generator.network.synthesis.calls[-1]
    assert call == {"shape": (3, 4, 5), "noise_mode": "const", "force_fp32": True, "all_equal": True}


def test_stylegan_pickle_adapter_draws_one_hot_classes_for_conditional_networks(tmp_path):
    """For a conditional network the adapter draws one-hot class vectors."""
    torch.manual_seed(0)
    generator = load_generator(f"stylegan-pkl:{_pickle(tmp_path, {'G_ema': FakeStyleGAN(c_dim=10)})}")
    generator.sample_w(6, _rng())
    c = generator.network.mapping.last_c
    assert c.shape == (6, 10) and torch.equal(c.sum(dim=1), torch.ones(6)) and set(c.unique().tolist()) == {0.0, 1.0}


def test_stylegan_pickle_errors(tmp_path):
    """A missing, non-StyleGAN or corrupt pickle is a one-line error."""
    with pytest.raises(ConfigError, match="not found"):
        load_generator(f"stylegan-pkl:{tmp_path / 'missing.pkl'}")
    with pytest.raises(CheckpointError, match="no StyleGAN generator"):
        load_generator(f"stylegan-pkl:{_pickle(tmp_path, {'G_ema': nn.Linear(1, 1)})}")
    (tmp_path / "garbage.pkl").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_generator(f"stylegan-pkl:{tmp_path / 'garbage.pkl'}")
