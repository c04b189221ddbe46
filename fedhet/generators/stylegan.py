"""A small style-based generator (StyleGAN2-like) and its discriminator, sized for CPUs.

This is the "faithful offline substitute" of reference ``fedktl.md`` section 9.3: FedKTL needs a
frozen generator with a *learned* mapping network (so W is not simply Gaussian) and a synthesis
network that turns any ``w`` in W into a natural-looking image. Following Karras et al.,
"Analyzing and Improving the Image Quality of StyleGAN" (CVPR 2020):

* mapping ``G_m``: pixel-norm on ``z`` (``z_dim`` = 64), then ``mapping_layers`` = 4 fully connected
  layers with LeakyReLU(0.2) and a 0.01 learning-rate multiplier, to ``w`` (``w_dim`` = 128, the
  H = 128 of section 4.5);
* synthesis ``G_s``: a learned 4x4 constant, one modulated 3x3 convolution at 4x4, then one
  up-block per doubling (bilinear upsample, modulated + demodulated 3x3 convolution, LeakyReLU),
  every resolution adding its modulated 1x1 "toRGB" output to the upsampled image so far (the
  skip architecture), then ``tanh`` so outputs lie in ``[-1, 1]``;
* all layers use equalised learning rate (weights ``N(0, 1)`` scaled by ``1/sqrt(fan_in)`` at run
  time), which keeps Adam's effective step equal across layers;
* channels per resolution ``min(channel_base / res, channel_max)``: 128, 64, 32, 16 at 4..32
  (sized so that pretraining takes minutes on two CPU cores; see ``docs/generators.md``).

Deviations from StyleGAN2, all for CPU cost or because FedKTL does not need them: one
convolution per up-block instead of two (section 9.3 suggests one), no per-pixel noise inputs
(FedKTL synthesises with ``noise_mode='const'``, i.e. ``G_s`` is a deterministic function of
``w``), no style mixing or path-length regularisation, modulation applied to activations rather
than by grouped convolution (mathematically identical, faster on CPUs), and a ``tanh`` output
(StyleGAN's is linear and clamped) so the ``[-1, 1]`` range holds by construction.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhet.errors import ConfigError
from fedhet.generators.base import UNTRAINED_SEED, GeneratorAdapter
from fedhet.seeding import seeded

__all__ = [
    "Discriminator",
    "StyleGenerator",
    "StyleGeneratorAdapter",
    "StyleGeneratorConfig",
]

_LRELU_GAIN = math.sqrt(2.0)
"""LeakyReLU gain of StyleGAN: keeps the activations' second moment at one through the stack."""


@dataclass(frozen=True)
class StyleGeneratorConfig:
    """Architecture of :class:`StyleGenerator` and :class:`Discriminator` (stored in artifacts).

    Attributes:
        z_dim: size of the Gaussian input ``z``.
        w_dim: size of the intermediate latent ``w`` (the adapter's ``latent_dim``).
        mapping_layers: fully connected layers of the mapping network.
        resolution: output side, a power of two >= 8 (32 by default, 16 for the cheap option).
        out_channels: image channels.
        channel_base: channels at resolution ``r`` are ``min(channel_base // r, channel_max)``.
        channel_max: channel cap.
    """

    z_dim: int = 64
    w_dim: int = 128
    mapping_layers: int = 4
    resolution: int = 32
    out_channels: int = 3
    channel_base: int = 512
    channel_max: int = 128

    def __post_init__(self) -> None:
        log2 = math.log2(self.resolution) if self.resolution > 0 else -1
        if log2 != int(log2) or self.resolution < 8:
            raise ConfigError(f"generator resolution must be a power of two >= 8, got {self.resolution}; use 16 or 32")
        for field in ("z_dim", "w_dim", "mapping_layers", "out_channels", "channel_base", "channel_max"):
            if getattr(self, field) < 1:
                raise ConfigError(f"generator {field} must be >= 1, got {getattr(self, field)}")

    def channels(self, resolution: int) -> int:
        """Feature channels at ``resolution`` (at least 1)."""
        return max(1, min(self.channel_base // resolution, self.channel_max))

    @property
    def resolutions(self) -> list[int]:
        """4, 8, ..., resolution."""
        return [2**k for k in range(2, int(math.log2(self.resolution)) + 1)]

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def _lrelu(x: Tensor) -> Tensor:
    return F.leaky_relu(x, 0.2) * _LRELU_GAIN


class EqualizedLinear(nn.Module):
    """Linear layer with equalised learning rate (weights scaled by ``lr_multiplier / sqrt(in)`` at run time)."""

    def __init__(self, in_features: int, out_features: int, bias_init: float = 0.0, lr_multiplier: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features) / lr_multiplier)
        self.bias = nn.Parameter(torch.full((out_features,), float(bias_init) / lr_multiplier))
        self.weight_gain = lr_multiplier / math.sqrt(in_features)
        self.lr_multiplier = lr_multiplier

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight * self.weight_gain, self.bias * self.lr_multiplier)


class EqualizedConv2d(nn.Module):
    """Convolution with equalised learning rate and "same" padding."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_channels, in_channels, kernel_size, kernel_size))
        self.bias = nn.Parameter(torch.zeros(out_channels))
        self.weight_gain = 1.0 / math.sqrt(in_channels * kernel_size * kernel_size)

    def forward(self, x: Tensor) -> Tensor:
        return F.conv2d(x, self.weight * self.weight_gain, self.bias, padding=self.weight.shape[-1] // 2)


class ModulatedConv2d(nn.Module):
    """StyleGAN2 modulated convolution: per-sample input scales from ``w``, optional demodulation.

    ``conv(x * s, W) * d`` with ``d_o = 1 / sqrt(sum_{i,k} (W_oik s_i)^2)`` equals a convolution
    with the per-sample weights ``W_oik s_i d_o`` (StyleGAN2's non-fused path), without grouped
    convolutions.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, w_dim: int, demodulate: bool) -> None:
        super().__init__()
        self.affine = EqualizedLinear(w_dim, in_channels, bias_init=1.0)  # styles start at 1
        self.weight = nn.Parameter(torch.randn(out_channels, in_channels, kernel_size, kernel_size))
        self.bias = nn.Parameter(torch.zeros(out_channels))
        self.weight_gain = 1.0 / math.sqrt(in_channels * kernel_size * kernel_size)
        self.demodulate = demodulate

    def forward(self, x: Tensor, w: Tensor) -> Tensor:
        styles = self.affine(w)  # [n, in]
        weight = self.weight * self.weight_gain
        x = F.conv2d(x * styles[:, :, None, None], weight, padding=weight.shape[-1] // 2)
        if self.demodulate:
            # sum_{i,k} W_oik^2 s_i^2 = (W^2 summed over k) @ s^2
            demod = (styles.square() @ weight.square().sum(dim=(2, 3)).T + 1e-8).rsqrt()  # [n, out]
            x = x * demod[:, :, None, None]
        return x + self.bias[None, :, None, None]


class MappingNetwork(nn.Module):
    """``G_m``: pixel-normalised ``z`` through fully connected layers with LeakyReLU to ``w``."""

    def __init__(self, config: StyleGeneratorConfig) -> None:
        super().__init__()
        dims = [config.z_dim] + [config.w_dim] * config.mapping_layers
        self.layers = nn.ModuleList(
            EqualizedLinear(a, b, lr_multiplier=0.01) for a, b in zip(dims[:-1], dims[1:], strict=False)
        )

    def forward(self, z: Tensor) -> Tensor:
        x = z * (z.square().mean(dim=1, keepdim=True) + 1e-8).rsqrt()  # pixel norm
        for layer in self.layers:
            x = _lrelu(layer(x))
        return x


class SynthesisNetwork(nn.Module):
    """``G_s``: learned 4x4 constant, modulated convolutions per resolution, skip toRGB, ``tanh``."""

    def __init__(self, config: StyleGeneratorConfig) -> None:
        super().__init__()
        resolutions = config.resolutions
        self.const = nn.Parameter(torch.randn(config.channels(4), 4, 4))
        self.convs = nn.ModuleList()
        self.to_rgb = nn.ModuleList()
        previous = config.channels(4)
        for resolution in resolutions:
            channels = config.channels(resolution)
            self.convs.append(ModulatedConv2d(previous, channels, 3, config.w_dim, demodulate=True))
            self.to_rgb.append(ModulatedConv2d(channels, config.out_channels, 1, config.w_dim, demodulate=False))
            previous = channels

    def forward(self, w: Tensor) -> Tensor:
        x = self.const[None].expand(w.shape[0], -1, -1, -1)
        image: Tensor | None = None
        for index, (conv, to_rgb) in enumerate(zip(self.convs, self.to_rgb, strict=False)):
            if index > 0:
                x = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
            x = _lrelu(conv(x, w))
            rgb = to_rgb(x, w)
            if image is None:
                image = rgb
            else:
                image = F.interpolate(image, scale_factor=2, mode="bilinear", align_corners=False) + rgb
        assert image is not None
        return torch.tanh(image)


class StyleGenerator(nn.Module):
    """Trainable mapping + synthesis pair; :class:`StyleGeneratorAdapter` is its frozen form."""

    def __init__(self, config: StyleGeneratorConfig | None = None) -> None:
        super().__init__()
        self.config = config or StyleGeneratorConfig()
        self.mapping = MappingNetwork(self.config)
        self.synthesis = SynthesisNetwork(self.config)

    def forward(self, z: Tensor) -> Tensor:
        return self.synthesis(self.mapping(z))


class Discriminator(nn.Module):
    """Small StyleGAN-like discriminator.

    fromRGB, conv + 2x average-pool per resolution, minibatch standard deviation at 4x4, then two
    fully connected layers to one logit.
    """

    def __init__(self, config: StyleGeneratorConfig | None = None, mbstd_group: int = 4) -> None:
        super().__init__()
        config = config or StyleGeneratorConfig()
        resolutions = list(reversed(config.resolutions))  # resolution .. 4
        self.from_rgb = EqualizedConv2d(config.out_channels, config.channels(resolutions[0]), 1)
        self.blocks = nn.ModuleList(
            EqualizedConv2d(config.channels(res), config.channels(res // 2), 3) for res in resolutions[:-1]
        )
        last = config.channels(4)
        self.mbstd_group = mbstd_group
        self.final_conv = EqualizedConv2d(last + 1, last, 3)
        self.fc = EqualizedLinear(last * 16, last)
        self.out = EqualizedLinear(last, 1)

    def minibatch_stddev(self, x: Tensor) -> Tensor:
        """Append the mean over features of the per-group standard deviation (one extra channel)."""
        n, c, h, w = x.shape
        group = min(self.mbstd_group, n)
        while n % group:
            group -= 1
        y = x.reshape(group, n // group, c, h, w)
        y = (y.var(dim=0, unbiased=False) + 1e-8).sqrt().mean(dim=(1, 2, 3))  # [n // group]
        y = y.repeat(group)[:, None, None, None].expand(n, 1, h, w)
        return torch.cat([x, y], dim=1)

    def forward(self, image: Tensor) -> Tensor:
        x = _lrelu(self.from_rgb(image))
        for block in self.blocks:
            x = F.avg_pool2d(_lrelu(block(x)), 2)
        x = _lrelu(self.final_conv(self.minibatch_stddev(x)))
        return self.out(_lrelu(self.fc(x.flatten(1)))).squeeze(1)


class StyleGeneratorAdapter(GeneratorAdapter):
    """A frozen :class:`StyleGenerator` behind the :class:`GeneratorAdapter` interface.

    Args:
        generator: the (pretrained) generator; it is frozen and owned by the adapter.
    """

    def __init__(self, generator: StyleGenerator) -> None:
        super().__init__()
        self.generator = generator
        self.latent_dim = generator.config.w_dim
        self.resolution = generator.config.resolution
        self.out_channels = generator.config.out_channels
        self.freeze()

    @classmethod
    def untrained(cls, config: StyleGeneratorConfig | None = None) -> StyleGeneratorAdapter:
        """A randomly initialised generator from :data:`UNTRAINED_SEED`: identical in every process.

        It has no pretrained knowledge, so FedKTL with it does not reproduce the paper; use it for
        tests and the no-pretraining ablation only.
        """
        with seeded(UNTRAINED_SEED):
            return cls(StyleGenerator(config))

    def sample_w(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        z = self.draw_noise(n, self.generator.config.z_dim, generator)
        return self.generator.mapping(z)

    def synthesize(self, w: Tensor) -> Tensor:
        self.check_latents(w)
        return self.generator.synthesis(w)
