"""ResNets: CPU-sized CIFAR ResNets, FCCL+'s CIFAR ResNets, HtFLlib's ResNet4-10 and torchvision's 18-152.

Three stems exist in the papers fedhet reproduces, and they are kept apart on purpose:

- CIFAR stem (FCCL+ / mammoth): ``conv3x3 stride 1 + BN + ReLU``, no max-pool, stages with
  strides 1/2/2/2. Used by ``resnet10_tiny`` / ``resnet12_tiny`` (widths 8..64, CPU) and
  ``resnet{10,12,18,34}_cifar`` (widths 64..512, the FCCL+ paper models).
- ImageNet stem (HtFLlib, FedKTL): ``conv7x7 stride 2 + BN + ReLU + maxpool``, applied unchanged
  to 32x32 inputs, so the last stage runs at 1x1. ``resnet4/6/8/10`` are HtFLlib's
  (``flcore/trainmodel/resnet.py``); ``resnet18..152`` are torchvision's, as HtFLlib builds them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torchvision
from torch import Tensor, nn
from torchvision.models.resnet import BasicBlock, Bottleneck

from fedhet.models._layers import kaiming_conv_init, replace_conv
from fedhet.models._registry import register_model
from fedhet.models.base import FeatureClassifier

__all__ = ["ResNet", "TorchvisionResNet"]


class ResNet(FeatureClassifier):
    """A ResNet with a configurable stem, number of stages and widths (torchvision blocks and init).

    Args:
        num_classes: number of logits.
        in_channels: image channels.
        layers: blocks per stage; its length is the number of stages (1 to 4 or more).
        widths: channels per stage (``planes``); the feature size is ``widths[-1] * expansion``.
        stem: ``"cifar"`` (conv3x3/1, no max-pool) or ``"imagenet"`` (conv7x7/2 + max-pool).
        block: ``BasicBlock`` or ``Bottleneck`` from torchvision.
        **kwargs: ``feature_dim`` / ``feature_proj`` (see :class:`FeatureClassifier`).
    """

    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        layers: Sequence[int] = (1, 1, 1, 1),
        widths: Sequence[int] = (64, 128, 256, 512),
        stem: str = "cifar",
        block: type[BasicBlock] | type[Bottleneck] = BasicBlock,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if len(widths) < len(layers):
            raise ValueError(f"need one width per stage, got layers={list(layers)} widths={list(widths)}")
        self.inplanes = widths[0]
        if stem == "cifar":
            self.conv1 = nn.Conv2d(in_channels, self.inplanes, 3, stride=1, padding=1, bias=False)
            self.maxpool: nn.Module = nn.Identity()
        elif stem == "imagenet":
            self.conv1 = nn.Conv2d(in_channels, self.inplanes, 7, stride=2, padding=3, bias=False)
            self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        else:
            raise ValueError(f"unknown stem {stem!r}; use 'cifar' or 'imagenet'")
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.layers = nn.Sequential(
            *(self._make_stage(block, widths[i], n, stride=1 if i == 0 else 2) for i, n in enumerate(layers))
        )
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        for m in self.modules():  # torchvision's (and HtFLlib's) initialisation
            if isinstance(m, nn.Conv2d):
                kaiming_conv_init(m)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        self._init_head(widths[len(layers) - 1] * block.expansion, num_classes, **kwargs)

    def _make_stage(
        self, block: type[BasicBlock] | type[Bottleneck], planes: int, blocks: int, stride: int
    ) -> nn.Module:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * block.expansion, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes * block.expansion),
            )
        stage = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        stage += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*stage)

    def forward_pooled(self, x: Tensor) -> Tensor:
        """Return the globally average-pooled output of the last stage."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        return torch.flatten(self.avgpool(self.layers(x)), 1)


class TorchvisionResNet(FeatureClassifier):
    """The torchvision ResNet-18/34/50/101/152 (``weights=None``) with ``fc`` split off as ``head``.

    The ImageNet stem is kept unchanged at 32x32, as HtFLlib does (``torchvision.models.resnetXX(
    pretrained=False)``); features are the 512 (Basic) or 2048 (Bottleneck) pooled channels.

    Args:
        num_classes: number of logits.
        in_channels: image channels (a non-3 value replaces ``conv1``, kaiming-initialised).
        depth: 18, 34, 50, 101 or 152.
        **kwargs: ``feature_dim`` / ``feature_proj``.
    """

    def __init__(self, num_classes: int, in_channels: int = 3, depth: int = 18, **kwargs: Any) -> None:
        super().__init__()
        builder = getattr(torchvision.models, f"resnet{depth}")
        # num_classes is passed so the classifier thrown away below is small.
        self.body = builder(weights=None, num_classes=num_classes)
        dim = self.body.fc.in_features
        self.body.fc = nn.Identity()
        if in_channels != 3:
            self.body.conv1 = replace_conv(self.body.conv1, in_channels, kaiming_conv_init)
        self._init_head(dim, num_classes, **kwargs)

    def forward_pooled(self, x: Tensor) -> Tensor:
        """Return torchvision's flattened average-pooled features (``fc`` is an identity)."""
        return self.body(x)


def _tiny_widths(width: int) -> tuple[int, int, int, int]:
    return (width, 2 * width, 4 * width, 8 * width)


@register_model(tags=("cpu", "fccl"))
def resnet10_tiny(num_classes: int, in_channels: int = 3, width: int = 8, **kwargs: Any) -> ResNet:
    """CIFAR ResNet-10 at CPU size: BasicBlocks [1,1,1,1], widths 8/16/32/64, 64 features (~78k params)."""
    return ResNet(num_classes, in_channels, (1, 1, 1, 1), _tiny_widths(width), "cifar", **kwargs)


@register_model(tags=("cpu", "fccl"))
def resnet12_tiny(num_classes: int, in_channels: int = 3, width: int = 8, **kwargs: Any) -> ResNet:
    """CIFAR ResNet-12 at CPU size: BasicBlocks [2,1,1,1], widths 8/16/32/64, 64 features (~79k params)."""
    return ResNet(num_classes, in_channels, (2, 1, 1, 1), _tiny_widths(width), "cifar", **kwargs)


def _cifar(layers: tuple[int, ...], num_classes: int, in_channels: int, width: int, kwargs: dict[str, Any]) -> ResNet:
    return ResNet(num_classes, in_channels, layers, _tiny_widths(width), "cifar", **kwargs)


@register_model(tags=("fccl", "gpu"))
def resnet10_cifar(num_classes: int, in_channels: int = 3, width: int = 64, **kwargs: Any) -> ResNet:
    """FCCL+'s ResNet10 (mammoth CIFAR stem, [1,1,1,1], widths 64..512), 512 features."""
    return _cifar((1, 1, 1, 1), num_classes, in_channels, width, kwargs)


@register_model(tags=("fccl", "gpu"))
def resnet12_cifar(num_classes: int, in_channels: int = 3, width: int = 64, **kwargs: Any) -> ResNet:
    """FCCL+'s ResNet12 (mammoth CIFAR stem, [2,1,1,1], widths 64..512), 512 features."""
    return _cifar((2, 1, 1, 1), num_classes, in_channels, width, kwargs)


@register_model(tags=("fccl", "gpu"))
def resnet18_cifar(num_classes: int, in_channels: int = 3, width: int = 64, **kwargs: Any) -> ResNet:
    """FCCL+'s ResNet18 (mammoth CIFAR stem, [2,2,2,2], widths 64..512), 512 features."""
    return _cifar((2, 2, 2, 2), num_classes, in_channels, width, kwargs)


@register_model(tags=("fccl", "gpu"))
def resnet34_cifar(num_classes: int, in_channels: int = 3, width: int = 64, **kwargs: Any) -> ResNet:
    """FCCL+'s ResNet34 (mammoth CIFAR stem, [3,4,6,3], widths 64..512), 512 features."""
    return _cifar((3, 4, 6, 3), num_classes, in_channels, width, kwargs)


def _htfllib(stages: int, num_classes: int, in_channels: int, kwargs: dict[str, Any]) -> ResNet:
    return ResNet(num_classes, in_channels, (1,) * stages, (64, 128, 256, 512), "imagenet", **kwargs)


@register_model(tags=("htfllib", "gpu"))
def resnet4(num_classes: int, in_channels: int = 3, **kwargs: Any) -> ResNet:
    """HtFLlib's ResNet4 (HtFE-img-9): ImageNet stem, one stage of one BasicBlock, 64 features."""
    return _htfllib(1, num_classes, in_channels, kwargs)


@register_model(tags=("htfllib", "gpu"))
def resnet6(num_classes: int, in_channels: int = 3, **kwargs: Any) -> ResNet:
    """HtFLlib's ResNet6 (HtFE-img-9): ImageNet stem, BasicBlock stages [1,1], 128 features."""
    return _htfllib(2, num_classes, in_channels, kwargs)


@register_model(tags=("htfllib", "gpu"))
def resnet8(num_classes: int, in_channels: int = 3, **kwargs: Any) -> ResNet:
    """HtFLlib's ResNet8 (HtFE-img-9): ImageNet stem, BasicBlock stages [1,1,1], 256 features."""
    return _htfllib(3, num_classes, in_channels, kwargs)


@register_model(tags=("htfllib", "gpu"))
def resnet10(num_classes: int, in_channels: int = 3, **kwargs: Any) -> ResNet:
    """HtFLlib's ResNet10 (HtFE-img-3/9): ImageNet stem, BasicBlock stages [1,1,1,1], 512 features."""
    return _htfllib(4, num_classes, in_channels, kwargs)


@register_model(tags=("torchvision", "htfllib", "gpu"))
def resnet18(num_classes: int, in_channels: int = 3, **kwargs: Any) -> TorchvisionResNet:
    """ResNet-18 from torchvision (``weights=None``), ImageNet stem at native resolution, 512 features."""
    return TorchvisionResNet(num_classes, in_channels, depth=18, **kwargs)


@register_model(tags=("torchvision", "htfllib", "gpu"))
def resnet34(num_classes: int, in_channels: int = 3, **kwargs: Any) -> TorchvisionResNet:
    """ResNet-34 from torchvision (``weights=None``), ImageNet stem at native resolution, 512 features."""
    return TorchvisionResNet(num_classes, in_channels, depth=34, **kwargs)


@register_model(tags=("torchvision", "htfllib", "gpu"))
def resnet50(num_classes: int, in_channels: int = 3, **kwargs: Any) -> TorchvisionResNet:
    """ResNet-50 from torchvision (``weights=None``), ImageNet stem at native resolution, 2048 features."""
    return TorchvisionResNet(num_classes, in_channels, depth=50, **kwargs)


@register_model(tags=("torchvision", "htfllib", "gpu"))
def resnet101(num_classes: int, in_channels: int = 3, **kwargs: Any) -> TorchvisionResNet:
    """ResNet-101 from torchvision (``weights=None``), ImageNet stem at native resolution, 2048 features."""
    return TorchvisionResNet(num_classes, in_channels, depth=101, **kwargs)


@register_model(tags=("torchvision", "htfllib", "gpu"))
def resnet152(num_classes: int, in_channels: int = 3, **kwargs: Any) -> TorchvisionResNet:
    """ResNet-152 from torchvision (``weights=None``), ImageNet stem at native resolution, 2048 features."""
    return TorchvisionResNet(num_classes, in_channels, depth=152, **kwargs)
