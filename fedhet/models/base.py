"""The one contract every fedhet backbone follows: a pooled feature extractor plus a linear head.

Heterogeneous FL methods talk to client models only through this split (timm's
``forward_features`` / ``forward_head`` / ``num_features`` contract, made pooled and flat):

- prototype methods (FedProto, FedTGP, FedKTL) average ``forward_features`` per class;
- head-sharing methods (LG-FedAvg, FedGH) exchange or replace the submodule named ``head``;
- logit methods (FedMD, FD, FCCL+) only call ``forward``.

Nothing outside ``fedhet/models`` may reach into a model by attribute sniffing (HtFLlib's
``BaseHeadSplit`` looks for ``fc`` / ``classifier`` / ``head``); the registry contract test holds
every registered model to this interface instead.
"""

from __future__ import annotations

from torch import Tensor, nn

from fedhet.errors import ConfigError

FEATURE_PROJECTIONS = ("pool", "linear")
"""Ways to map the backbone's pooled vector to a requested ``feature_dim`` (see ``FeatureClassifier``)."""


class FeatureClassifier(nn.Module):
    """Base class of every registered model: ``forward(x) = forward_head(forward_features(x))``.

    A subclass builds its layers, calls :meth:`_init_head` last (so the head is created after the
    body, as in the original architectures) and implements :meth:`forward_pooled`, which returns the
    globally pooled, flattened vector of the backbone (``[B, num_backbone_features]``).

    ``feature_dim`` lets every client of a heterogeneous family emit features of one shared size,
    which methods that exchange heads or compare features across architectures need:

    - ``feature_proj="pool"`` is HtFLlib's trick (``BaseHeadSplit``): ``nn.AdaptiveAvgPool1d(feature_dim)``
      on the flat vector, so 2048 -> 512 averages groups of 4 and 64 -> 512 replicates entries. It has
      no parameters, which is why HtFLlib, FedKTL and FedTGP use it (``feature_dim = 512`` there).
    - ``feature_proj="linear"`` is a learnable ``nn.Linear`` projection instead, which does not
      throw information away when shrinking; it is part of the feature extractor, not of ``head``.

    With ``feature_dim=None`` (or equal to the native size) nothing is added (``nn.Identity``).

    Attributes:
        num_classes: number of logits ``forward_head`` returns.
        num_features: size of ``forward_features``' output, the input size of ``head``.
        num_backbone_features: size of the pooled backbone vector before the optional projection.
        neck: the projection to ``feature_dim`` (``nn.Identity`` when none was asked for).
        head: ``nn.Linear(num_features, num_classes)``; methods may exchange or replace it.
    """

    num_classes: int
    num_features: int
    num_backbone_features: int
    neck: nn.Module
    head: nn.Module

    def _init_head(
        self,
        num_backbone_features: int,
        num_classes: int,
        feature_dim: int | None = None,
        feature_proj: str = "pool",
    ) -> None:
        """Create ``neck`` and ``head``; call at the end of a subclass ``__init__``.

        Args:
            num_backbone_features: size of the vector :meth:`forward_pooled` returns.
            num_classes: number of output logits.
            feature_dim: shared feature size to project to, or ``None`` to keep the native size.
            feature_proj: ``"pool"`` (HtFLlib's parameter-free ``AdaptiveAvgPool1d``) or ``"linear"``.
        """
        if num_classes < 1:
            raise ConfigError(f"num_classes must be a positive integer, got {num_classes}; set model num_classes >= 1")
        if feature_proj not in FEATURE_PROJECTIONS:
            raise ConfigError(f"unknown feature_proj {feature_proj!r}; use one of {', '.join(FEATURE_PROJECTIONS)}")
        if feature_dim is not None and feature_dim < 1:
            raise ConfigError(f"feature_dim must be a positive integer or null, got {feature_dim}")
        self.num_classes = num_classes
        self.num_backbone_features = num_backbone_features
        if feature_dim is None or feature_dim == num_backbone_features:
            self.neck = nn.Identity()
            self.num_features = num_backbone_features
        elif feature_proj == "pool":
            # On a [B, D] input AdaptiveAvgPool1d sees an unbatched (C=B, L=D) signal and pools D,
            # exactly what HtFLlib applies to the flattened penultimate vector.
            self.neck = nn.AdaptiveAvgPool1d(feature_dim)
            self.num_features = feature_dim
        else:
            self.neck = nn.Linear(num_backbone_features, feature_dim)
            self.num_features = feature_dim
        # A fresh default-initialised Linear, as HtFLlib builds its shared head (not the
        # torchvision classifier, whose init differs per architecture).
        self.head = nn.Linear(self.num_features, num_classes)

    def forward_pooled(self, x: Tensor) -> Tensor:
        """Return the backbone's globally pooled, flattened vector ``[B, num_backbone_features]``."""
        raise NotImplementedError(f"{type(self).__name__} must implement forward_pooled")

    def forward_features(self, x: Tensor) -> Tensor:
        """Return the feature vector ``[B, num_features]`` that prototypes and heads operate on."""
        return self.neck(self.forward_pooled(x))

    def forward_head(self, z: Tensor) -> Tensor:
        """Map features ``[B, num_features]`` to logits ``[B, num_classes]`` with ``head``."""
        return self.head(z)

    def forward(self, x: Tensor) -> Tensor:
        """Return logits ``[B, num_classes]``; always equal to ``forward_head(forward_features(x))``."""
        return self.forward_head(self.forward_features(x))
