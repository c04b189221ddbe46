"""A CPU-sized CIFAR MobileNetV2 (the depthwise-separable member of the embedded ``cpu4`` family)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torchvision.models.mobilenetv2 import InvertedResidual

from fedhet.models._registry import register_model
from fedhet.models.base import FeatureClassifier

__all__ = ["CifarMobileNetV2"]

TINY_SETTINGS: tuple[tuple[int, int, int, int], ...] = ((1, 8, 1, 1), (4, 12, 2, 2), (4, 16, 2, 2), (4, 32, 2, 2))
"""(expansion t, channels c, blocks n, first stride s) per stage, from the FCCL+ spec §9.3."""


class CifarMobileNetV2(FeatureClassifier):
    """MobileNetV2 with a CIFAR stem (conv3x3 stride 1), torchvision's inverted residual blocks.

    ``conv3x3(in -> stem) + BN + ReLU6 -> inverted residual stages -> conv1x1(-> last) + BN + ReLU6
    -> global average pool``; ``last`` features. It stands in for FCCL+'s EfficientNet-B0 /
    MobileNetV2 on CPU: what matters for heterogeneity is a depthwise-separable architecture with
    a feature size unlike the ResNets'.

    Args:
        num_classes: number of logits.
        in_channels: image channels.
        settings: ``(t, c, n, s)`` per stage, as in the MobileNetV2 paper.
        stem: channels of the stem convolution.
        last: channels of the final 1x1 convolution (= feature size).
        width_mult: multiplies every channel count except ``last`` (rounded, at least 4).
        **kwargs: ``feature_dim`` / ``feature_proj`` (see :class:`FeatureClassifier`).
    """

    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        settings: Sequence[tuple[int, int, int, int]] = TINY_SETTINGS,
        stem: int = 8,
        last: int = 128,
        width_mult: float = 1.0,
        **kwargs: Any,
    ) -> None:
        super().__init__()

        def scaled(c: int) -> int:
            return max(4, round(c * width_mult))

        channels = scaled(stem)
        layers: list[nn.Module] = [
            nn.Conv2d(in_channels, channels, 3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU6(inplace=True),
        ]
        for t, c, n, s in settings:
            for i in range(n):
                layers.append(InvertedResidual(channels, scaled(c), s if i == 0 else 1, t))
                channels = scaled(c)
        layers += [nn.Conv2d(channels, last, 1, bias=False), nn.BatchNorm2d(last), nn.ReLU6(inplace=True)]
        self.features = nn.Sequential(*layers)
        for m in self.modules():  # torchvision's MobileNetV2 initialisation
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        self._init_head(last, num_classes, **kwargs)

    def forward_pooled(self, x: Tensor) -> Tensor:
        """Return the globally average-pooled output of the final 1x1 convolution."""
        return torch.flatten(nn.functional.adaptive_avg_pool2d(self.features(x), 1), 1)


@register_model(tags=("cpu", "fccl"))
def mobilenetv2_tiny(
    num_classes: int, in_channels: int = 3, width_mult: float = 1.0, **kwargs: Any
) -> CifarMobileNetV2:
    """CIFAR MobileNetV2 at CPU size: (t,c,n,s) = (1,8,1,1),(4,12,2,2),(4,16,2,2),(4,32,2,2), 1x1 -> 128 (~28k)."""
    return CifarMobileNetV2(num_classes, in_channels, TINY_SETTINGS, stem=8, last=128, width_mult=width_mult, **kwargs)
