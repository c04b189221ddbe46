"""FCCL+'s CIFAR-style EfficientNet-B0, MobileNetV2 and GoogLeNet (kuangliu/pytorch-cifar designs).

FCCL+ (Tab. VI) trains these from scratch on 32x32 images next to its CIFAR ResNets
(:mod:`fedhet.models.resnet`). They differ from torchvision's ImageNet versions in the stem
(3x3 stride-1 convolutions, so 32x32 inputs keep their resolution) and in details listed per
class. Spec: reference/fccl-plus.md section 4.4.

Deviations from the kuangliu code FCCL+ copies, all recorded in the class docstrings:

- Global pooling is adaptive (``adaptive_avg_pool2d(1)``) instead of the fixed ``avg_pool2d(4)``
  / ``AvgPool2d(8)``; at 32x32 both give 1x1, and adaptive pooling also serves 16x16 tests.
- EfficientNet: kuangliu builds the expansion convolution of expansion-1 blocks without using it;
  fedhet does not create that dead layer (the contract requires every parameter to get a
  gradient). kuangliu computes drop-connect rates as ``0.2 * b / blocks`` but never increments
  ``b``, so drop-connect is silently off; fedhet applies the intended linear schedule (EfficientNet
  paper), and ``drop_connect_rate=0`` reproduces the code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhet.models._registry import register_model
from fedhet.models.base import FeatureClassifier

__all__ = ["CifarEfficientNetB0", "CifarGoogLeNet", "KuangliuMobileNetV2"]


# --------------------------------------------------------------------------------------------
# EfficientNet-B0 (CIFAR)
# --------------------------------------------------------------------------------------------

EFFICIENTNET_B0_STAGES: tuple[tuple[int, int, int, int, int], ...] = (
    # (expansion, out channels, blocks, kernel, first stride)
    (1, 16, 1, 3, 1),
    (6, 24, 2, 3, 2),
    (6, 40, 2, 5, 2),
    (6, 80, 3, 3, 2),
    (6, 112, 3, 5, 1),
    (6, 192, 4, 5, 2),
    (6, 320, 1, 3, 1),
)
"""kuangliu's EfficientNet-B0 configuration (FCCL+ spec 4.4)."""


def _drop_connect(x: Tensor, rate: float) -> Tensor:
    """Drop whole residual branches per sample with probability ``rate`` and rescale the rest."""
    keep = 1.0 - rate
    mask = torch.empty((x.shape[0], 1, 1, 1), dtype=x.dtype, device=x.device).bernoulli_(keep)
    return x / keep * mask


class _SqueezeExcite(nn.Module):
    """kuangliu's SE: GAP -> 1x1 conv (swish) -> 1x1 conv (sigmoid) -> channel scaling."""

    def __init__(self, channels: int, squeezed: int) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(channels, squeezed, 1, bias=True)
        self.expand = nn.Conv2d(squeezed, channels, 1, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        scale = F.silu(self.reduce(F.adaptive_avg_pool2d(x, 1)))
        return x * self.expand(scale).sigmoid()


class _MBConv(nn.Module):
    """Mobile inverted bottleneck with SE (ratio of the *input* channels, as kuangliu) and drop-connect."""

    def __init__(
        self, in_channels: int, out_channels: int, kernel: int, stride: int, expansion: int, drop_rate: float
    ) -> None:
        super().__init__()
        channels = expansion * in_channels
        self.expand: nn.Module = (
            nn.Identity()
            if expansion == 1
            else nn.Sequential(nn.Conv2d(in_channels, channels, 1, bias=False), nn.BatchNorm2d(channels), nn.SiLU())
        )
        self.depthwise = nn.Sequential(
            nn.Conv2d(channels, channels, kernel, stride, padding=kernel // 2, groups=channels, bias=False),
            nn.BatchNorm2d(channels),
            nn.SiLU(),
        )
        self.se = _SqueezeExcite(channels, int(in_channels * 0.25))
        self.project = nn.Sequential(nn.Conv2d(channels, out_channels, 1, bias=False), nn.BatchNorm2d(out_channels))
        self.has_skip = stride == 1 and in_channels == out_channels
        self.drop_rate = drop_rate

    def forward(self, x: Tensor) -> Tensor:
        out = self.project(self.se(self.depthwise(self.expand(x))))
        if not self.has_skip:
            return out
        if self.training and self.drop_rate > 0:
            out = _drop_connect(out, self.drop_rate)
        return out + x


class CifarEfficientNetB0(FeatureClassifier):
    """FCCL+'s EfficientNet-B0 for 32x32 inputs (kuangliu): 3x3/1 stem (32, swish), 16 MBConv blocks, 320 features.

    Dropout (``dropout``, 0.2) is applied to the pooled features in training mode, inside
    ``forward_features``, because FCCL+'s ``features()`` applies it there too.

    Args:
        num_classes: number of logits.
        in_channels: image channels.
        drop_connect_rate: final drop-connect rate, reached linearly over the blocks (0 = kuangliu's
            effective behaviour, see the module docstring).
        dropout: dropout on the pooled features in training mode.
        **kwargs: ``feature_dim`` / ``feature_proj`` (see :class:`FeatureClassifier`).
    """

    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        drop_connect_rate: float = 0.2,
        dropout: float = 0.2,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, 32, 3, stride=1, padding=1, bias=False), nn.BatchNorm2d(32), nn.SiLU()
        )
        total = sum(stage[2] for stage in EFFICIENTNET_B0_STAGES)
        blocks: list[nn.Module] = []
        channels = 32
        for expansion, out_channels, count, kernel, stride in EFFICIENTNET_B0_STAGES:
            for i in range(count):
                rate = drop_connect_rate * len(blocks) / total
                blocks.append(_MBConv(channels, out_channels, kernel, stride if i == 0 else 1, expansion, rate))
                channels = out_channels
        self.blocks = nn.Sequential(*blocks)
        self.dropout = nn.Dropout(dropout)
        self._init_head(channels, num_classes, **kwargs)

    def forward_pooled(self, x: Tensor) -> Tensor:
        """Return the pooled 320-d vector (dropout applied in training mode, as FCCL+'s ``features``)."""
        return self.dropout(torch.flatten(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))


@register_model(tags=("fccl", "gpu"))
def efficientnet_b0_cifar(
    num_classes: int, in_channels: int = 3, drop_connect_rate: float = 0.2, dropout: float = 0.2, **kwargs: Any
) -> CifarEfficientNetB0:
    """FCCL+'s CIFAR EfficientNet-B0 (kuangliu): stride-1 stem, SE 0.25, 320 features (Digits SVHN client)."""
    return CifarEfficientNetB0(num_classes, in_channels, drop_connect_rate, dropout, **kwargs)


# --------------------------------------------------------------------------------------------
# MobileNetV2 (CIFAR)
# --------------------------------------------------------------------------------------------

MOBILENETV2_CIFAR_STAGES: tuple[tuple[int, int, int, int], ...] = (
    (1, 16, 1, 1),
    (6, 24, 2, 1),  # stride 1 instead of ImageNet's 2: the CIFAR change
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)
"""(t, c, n, s) per stage of kuangliu's CIFAR MobileNetV2 (FCCL+ spec 4.4)."""


class _KuangliuInvertedResidual(nn.Module):
    """kuangliu's block: 1x1 expand (always, also for t=1), 3x3 depthwise, 1x1 project, ReLU.

    Unlike torchvision's InvertedResidual it uses ReLU (not ReLU6) and, for stride 1 with a channel
    change, a 1x1 conv + BN shortcut instead of no shortcut.
    """

    def __init__(self, in_channels: int, out_channels: int, expansion: int, stride: int) -> None:
        super().__init__()
        channels = expansion * in_channels
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, channels, 1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(channels, channels, 3, stride, padding=1, groups=channels, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(channels, out_channels, 1, bias=False),
            nn.BatchNorm2d(out_channels),
        )
        self.stride = stride
        self.shortcut: nn.Module = nn.Identity()
        if stride == 1 and in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.body(x)
        return out + self.shortcut(x) if self.stride == 1 else out


class KuangliuMobileNetV2(FeatureClassifier):
    """FCCL+'s CIFAR MobileNetV2 (kuangliu): 3x3/1 stem (32), inverted residuals, 1x1 conv to 1280 features.

    Args:
        num_classes: number of logits.
        in_channels: image channels.
        settings: ``(t, c, n, s)`` per stage.
        **kwargs: ``feature_dim`` / ``feature_proj`` (see :class:`FeatureClassifier`).
    """

    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        settings: Sequence[tuple[int, int, int, int]] = MOBILENETV2_CIFAR_STAGES,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            nn.Conv2d(in_channels, 32, 3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(32),
            nn.ReLU(inplace=True),
        ]
        channels = 32
        for t, c, n, s in settings:
            for i in range(n):
                layers.append(_KuangliuInvertedResidual(channels, c, t, s if i == 0 else 1))
                channels = c
        layers += [nn.Conv2d(channels, 1280, 1, bias=False), nn.BatchNorm2d(1280), nn.ReLU(inplace=True)]
        self.features = nn.Sequential(*layers)
        self._init_head(1280, num_classes, **kwargs)

    def forward_pooled(self, x: Tensor) -> Tensor:
        """Return the globally average-pooled 1280-d output of the final 1x1 convolution."""
        return torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1)


@register_model(tags=("fccl", "gpu"))
def mobilenetv2_cifar(num_classes: int, in_channels: int = 3, **kwargs: Any) -> KuangliuMobileNetV2:
    """FCCL+'s CIFAR MobileNetV2 (kuangliu): stride-1 stem and second stage, ReLU, 1280 features (Digits SYN client)."""
    return KuangliuMobileNetV2(num_classes, in_channels, **kwargs)


# --------------------------------------------------------------------------------------------
# GoogLeNet (CIFAR)
# --------------------------------------------------------------------------------------------


def _conv_bn_relu(in_channels: int, out_channels: int, kernel: int) -> list[nn.Module]:
    # kuangliu's convolutions keep their bias (PyTorch default) even before BatchNorm.
    conv = nn.Conv2d(in_channels, out_channels, kernel, padding=kernel // 2)
    return [conv, nn.BatchNorm2d(out_channels), nn.ReLU(True)]


class _Inception(nn.Module):
    """kuangliu's Inception: 1x1 | 1x1-3x3 | 1x1-3x3-3x3 (the 5x5 as two 3x3) | maxpool-1x1, concatenated."""

    def __init__(self, in_ch: int, n1: int, n3_red: int, n3: int, n5_red: int, n5: int, pool: int) -> None:
        super().__init__()
        self.b1 = nn.Sequential(*_conv_bn_relu(in_ch, n1, 1))
        self.b2 = nn.Sequential(*_conv_bn_relu(in_ch, n3_red, 1), *_conv_bn_relu(n3_red, n3, 3))
        self.b3 = nn.Sequential(
            *_conv_bn_relu(in_ch, n5_red, 1), *_conv_bn_relu(n5_red, n5, 3), *_conv_bn_relu(n5, n5, 3)
        )
        self.b4 = nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1), *_conv_bn_relu(in_ch, pool, 1))

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], 1)


GOOGLENET_INCEPTIONS: tuple[tuple[int, ...], ...] = (
    (192, 64, 96, 128, 16, 32, 32),  # a3
    (256, 128, 128, 192, 32, 96, 64),  # b3 -> maxpool
    (480, 192, 96, 208, 16, 48, 64),  # a4
    (512, 160, 112, 224, 24, 64, 64),  # b4
    (512, 128, 128, 256, 24, 64, 64),  # c4
    (512, 112, 144, 288, 32, 64, 64),  # d4
    (528, 256, 160, 320, 32, 128, 128),  # e4 -> maxpool
    (832, 256, 160, 320, 32, 128, 128),  # a5
    (832, 384, 192, 384, 48, 128, 128),  # b5
)
"""kuangliu's Inception configurations (in, 1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5, pool proj)."""


class CifarGoogLeNet(FeatureClassifier):
    """FCCL+'s CIFAR GoogLeNet (kuangliu): 3x3 pre-layer (192), Inception a3..b5, 1024 features.

    Max-pools (3x3 stride 2) follow b3 and e4, so a 32x32 input ends at 8x8 before the global pool.

    Args:
        num_classes: number of logits.
        in_channels: image channels.
        **kwargs: ``feature_dim`` / ``feature_proj`` (see :class:`FeatureClassifier`).
    """

    def __init__(self, num_classes: int, in_channels: int = 3, **kwargs: Any) -> None:
        super().__init__()
        layers: list[nn.Module] = [*_conv_bn_relu(in_channels, 192, 3)]
        for index, config in enumerate(GOOGLENET_INCEPTIONS):
            layers.append(_Inception(*config))
            if index in (1, 6):
                layers.append(nn.MaxPool2d(3, stride=2, padding=1))
        self.features = nn.Sequential(*layers)
        self._init_head(1024, num_classes, **kwargs)

    def forward_pooled(self, x: Tensor) -> Tensor:
        """Return the globally average-pooled 1024-d output of Inception b5."""
        return torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1)


@register_model(tags=("fccl", "gpu"))
def googlenet_cifar(num_classes: int, in_channels: int = 3, **kwargs: Any) -> CifarGoogLeNet:
    """FCCL+'s CIFAR GoogLeNet (kuangliu): 3x3 pre-layer, no stem downsampling, 1024 features."""
    return CifarGoogLeNet(num_classes, in_channels, **kwargs)
