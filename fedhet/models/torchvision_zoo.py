"""Paper-scale torchvision backbones (``weights=None``): GoogLeNet, MobileNetV2, EfficientNet-B0, ShuffleNetV2.

HtFLlib (and therefore FedKTL, FedTGP, FedGH ...) runs torchvision's ImageNet architectures on
32x32 CIFAR images without touching their stems; fedhet does the same, so the HtFE families
compare with the published numbers. Their final spatial maps are then 1x1, which is expected.
The torchvision classifier is removed and a fresh ``head = nn.Linear(num_features, C)`` is added,
which is what HtFLlib's ``BaseHeadSplit`` does. No weights are ever downloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torchvision
from torch import Tensor, nn

from fedhet.errors import ConfigError
from fedhet.models._layers import kaiming_conv_init, replace_conv, trunc_normal_conv_init
from fedhet.models._registry import register_model
from fedhet.models.base import FeatureClassifier

__all__ = ["TorchvisionClassifier"]


class TorchvisionClassifier(FeatureClassifier):
    """Wrap a torchvision classification network: its classifier becomes an identity, ``head`` is new.

    Args:
        body: the torchvision network, built with ``weights=None``.
        classifier: name of its classifier attribute (``"fc"`` or ``"classifier"``); the whole
            attribute is replaced by ``nn.Identity``, so anything inside it (a dropout) goes with it.
        stem: dotted path of its first convolution, replaced when ``in_channels != 3``.
        stem_init: initialisation for a replaced stem convolution (``None``: PyTorch's default).
        num_classes: number of logits.
        in_channels: image channels.
        **kwargs: ``feature_dim`` / ``feature_proj`` (see :class:`FeatureClassifier`).
    """

    def __init__(
        self,
        body: nn.Module,
        classifier: str,
        stem: str,
        stem_init: Callable[[nn.Conv2d], None] | None,
        num_classes: int,
        in_channels: int = 3,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self.body = body
        old = getattr(body, classifier)
        linear = old if isinstance(old, nn.Linear) else next(m for m in old.modules() if isinstance(m, nn.Linear))
        setattr(body, classifier, nn.Identity())
        if in_channels != 3:
            parent_path, _, attr = stem.rpartition(".")
            parent = body.get_submodule(parent_path) if parent_path else body
            setattr(parent, attr, replace_conv(getattr(parent, attr), in_channels, stem_init))
        self._init_head(linear.in_features, num_classes, **kwargs)

    def forward_pooled(self, x: Tensor) -> Tensor:
        """Return the torchvision network's output with its classifier removed (pooled and flat)."""
        return self.body(x)


@register_model(tags=("torchvision", "htfllib", "gpu"))
def googlenet(num_classes: int, in_channels: int = 3, **kwargs: Any) -> TorchvisionClassifier:
    """GoogLeNet from torchvision (``aux_logits=False, init_weights=True``), 1024 features.

    Only ``fc`` is removed, as in HtFLlib, so the dropout (p=0.2) before it stays in the feature
    extractor and ``forward_features`` is stochastic in training mode.
    """
    body = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=True, num_classes=num_classes)
    return TorchvisionClassifier(body, "fc", "conv1.conv", trunc_normal_conv_init, num_classes, in_channels, **kwargs)


@register_model(tags=("torchvision", "htfllib", "gpu"))
def mobilenet_v2(num_classes: int, in_channels: int = 3, **kwargs: Any) -> TorchvisionClassifier:
    """MobileNetV2 from torchvision (``weights=None``), 1280 features; the classifier's dropout is removed.

    HtFLlib uses its own copy of the torchvision MobileNetV2; fedhet uses torchvision's directly.
    """
    body = torchvision.models.mobilenet_v2(weights=None, num_classes=num_classes)
    return TorchvisionClassifier(
        body, "classifier", "features.0.0", kaiming_conv_init, num_classes, in_channels, **kwargs
    )


@register_model(tags=("torchvision", "gpu"))
def efficientnet_b0(num_classes: int, in_channels: int = 3, **kwargs: Any) -> TorchvisionClassifier:
    """EfficientNet-B0 from torchvision (``weights=None``), 1280 features; the classifier's dropout is removed.

    This is the ImageNet architecture; FCCL+ used a CIFAR variant (stride-1 stem, 320 features).
    Stochastic depth (0.2) stays active in training mode.
    """
    body = torchvision.models.efficientnet_b0(weights=None, num_classes=num_classes)
    return TorchvisionClassifier(
        body, "classifier", "features.0.0", kaiming_conv_init, num_classes, in_channels, **kwargs
    )


_SHUFFLENET_BUILDERS = {
    0.5: "shufflenet_v2_x0_5",
    1.0: "shufflenet_v2_x1_0",
    1.5: "shufflenet_v2_x1_5",
    2.0: "shufflenet_v2_x2_0",
}


@register_model(tags=("torchvision", "fccl", "gpu"))
def shufflenet_v2(
    num_classes: int, in_channels: int = 3, width_mult: float = 1.0, **kwargs: Any
) -> TorchvisionClassifier:
    """ShuffleNetV2 from torchvision (``weights=None``, x1.0 by default), 1024 features (2048 at x2.0)."""
    if width_mult not in _SHUFFLENET_BUILDERS:
        raise ConfigError(f"shufflenet_v2 width_mult must be one of {sorted(_SHUFFLENET_BUILDERS)}, got {width_mult}")
    body = getattr(torchvision.models, _SHUFFLENET_BUILDERS[width_mult])(weights=None, num_classes=num_classes)
    return TorchvisionClassifier(body, "fc", "conv1.0", None, num_classes, in_channels, **kwargs)
