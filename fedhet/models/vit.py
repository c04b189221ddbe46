"""torchvision's ViT-B/16 and ViT-B/32 (``weights=None``) at 32x32, the two extra members of FedKTL's HtM10.

HtFLlib builds them as ``torchvision.models.vit_b_16(image_size=32, num_classes=C)`` (and
``vit_b_32``): at 32x32 ViT-B/16 sees 4 patches and ViT-B/32 a single one, plus the class token.
The feature is the class token after the encoder's final LayerNorm (768 values); torchvision's
``heads`` is removed and a fresh ``head = nn.Linear(768, C)`` added, as for every fedhet model.

Deviation (spec fedktl.md 4.1): in HtM10 HtFLlib gives the ViTs an MLP head,
``Linear(512, 768) -> Tanh -> Linear(768, C)`` on the 512-pooled feature. fedhet's model contract
is a single linear ``head`` (methods exchange or read it), so the ViTs here have a linear head;
with ``feature_dim=512`` they share the head shape of the other HtFE models. The ViT-specific
MLP head is not reproduced.
"""

from __future__ import annotations

import math
from typing import Any

import torchvision
from torch import nn

from fedhet.errors import ConfigError
from fedhet.models._registry import register_model
from fedhet.models.torchvision_zoo import TorchvisionClassifier

__all__: list[str] = []


def _patch_embedding_init(conv: nn.Conv2d) -> None:
    """Initialise a replaced patch embedding as torchvision's ViT does (LeCun-normal, zero bias)."""
    fan_in = conv.in_channels * conv.kernel_size[0] * conv.kernel_size[1]
    nn.init.trunc_normal_(conv.weight, std=math.sqrt(1 / fan_in))
    if conv.bias is not None:
        nn.init.zeros_(conv.bias)


def _vit(builder: str, patch: int, num_classes: int, in_channels: int, image_size: int, kwargs: dict[str, Any]):
    if image_size < patch or image_size % patch:
        raise ConfigError(f"{builder} needs image_size a positive multiple of {patch}, got {image_size}")
    body = getattr(torchvision.models, builder)(weights=None, image_size=image_size, num_classes=num_classes)
    return TorchvisionClassifier(body, "heads", "conv_proj", _patch_embedding_init, num_classes, in_channels, **kwargs)


@register_model(tags=("torchvision", "htfllib", "gpu"))
def vit_b_16(num_classes: int, in_channels: int = 3, image_size: int = 32, **kwargs: Any) -> TorchvisionClassifier:
    """ViT-B/16 from torchvision (``weights=None``, ``image_size=32`` as HtFLlib), 768 features (~86M params).

    The input must be exactly ``image_size`` pixels square (position embeddings are fixed).
    """
    return _vit("vit_b_16", 16, num_classes, in_channels, image_size, kwargs)


@register_model(tags=("torchvision", "htfllib", "gpu"))
def vit_b_32(num_classes: int, in_channels: int = 3, image_size: int = 32, **kwargs: Any) -> TorchvisionClassifier:
    """ViT-B/32 from torchvision (``weights=None``, ``image_size=32`` as HtFLlib), 768 features (~88M params).

    The input must be exactly ``image_size`` pixels square (position embeddings are fixed).
    """
    return _vit("vit_b_32", 32, num_classes, in_channels, image_size, kwargs)
