"""Small helpers shared by the model files (not part of the public API)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def kaiming_conv_init(conv: nn.Conv2d) -> None:
    """Initialise a convolution as torchvision's ResNet does (MobileNetV2/EfficientNet differ only in gain)."""
    nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
    if conv.bias is not None:
        nn.init.zeros_(conv.bias)


def replace_conv(conv: nn.Conv2d, in_channels: int, init: Callable[[nn.Conv2d], None] | None) -> nn.Conv2d:
    """Return a copy of ``conv`` taking ``in_channels`` inputs, initialised like the original stem.

    Used to run 3-channel architectures on grey-scale data without tiling channels in the data
    pipeline. Only called when ``in_channels != conv.in_channels``, so the 3-channel models consume
    the RNG exactly as the upstream constructors do.
    """
    new = nn.Conv2d(
        in_channels,
        conv.out_channels,
        kernel_size=conv.kernel_size,  # type: ignore[arg-type]
        stride=conv.stride,  # type: ignore[arg-type]
        padding=conv.padding,  # type: ignore[arg-type]
        groups=conv.groups,
        bias=conv.bias is not None,
    )
    if init is not None:
        init(new)
    return new


def trunc_normal_conv_init(conv: nn.Conv2d) -> None:
    """Initialise a convolution as torchvision's GoogLeNet does with ``init_weights=True``."""
    nn.init.trunc_normal_(conv.weight, mean=0.0, std=0.01, a=-2, b=2)
