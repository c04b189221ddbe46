"""FCCL+ Tab. VI families, FedKTL's HtM10 and their new architectures (CIFAR-style CNNs, ViTs)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from fedhet.errors import ConfigError
from fedhet.models import create_client_model, create_model, get_family, is_homogeneous, resolve_family

NUM_CLASSES = 5


def _contract(model: nn.Module, x: torch.Tensor) -> None:
    """Check ``forward == head(forward_features)`` in eval mode and a train-mode backward reaching every parameter."""
    model.eval()
    with torch.no_grad():
        features = model.forward_features(x)
        torch.testing.assert_close(model(x), model.forward_head(features), rtol=0, atol=0)
    assert features.shape == (x.shape[0], model.num_features)
    model.train()
    model(x).logsumexp(1).mean().backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert not missing, missing[:5]
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize(
    ("family", "expected"),
    [
        ("fccl_digits", ["resnet10_cifar", "resnet12_cifar", "efficientnet_b0_cifar", "mobilenetv2_cifar"]),
        ("fccl_office_caltech", ["googlenet_cifar", "resnet12_cifar", "resnet10_cifar", "resnet12_cifar"]),
        ("fccl_office31", ["resnet10_cifar", "resnet12_cifar", "resnet10_cifar"]),
        ("fccl-officehome", ["resnet18_cifar", "resnet34_cifar", "googlenet_cifar", "resnet12_cifar"]),
    ],
)
def test_fccl_families_follow_table_vi(family: str, expected: list[str]) -> None:
    """FCCL+'s families resolve to the architectures of its Table VI, heterogeneous ones."""
    assert resolve_family(family) == expected
    assert not is_homogeneous(expected)


def test_htm10_is_htfe8_plus_two_vits() -> None:
    """HtM10 is HtFE8 plus ViT-B/16 and ViT-B/32, and family names are normalised."""
    htm10 = resolve_family("HtM10")
    assert htm10 == [*resolve_family("HtFE8"), "vit_b_16", "vit_b_32"]
    assert get_family("htm-img-10").name == "htm_img_10"


@pytest.mark.parametrize(
    ("name", "params", "features"),
    # kuangliu/pytorch-cifar sizes for 10 classes (MobileNetV2 2,296,922 and GoogLeNet 6,166,250 are
    # the figures that repository's models print; EfficientNet-B0 without the unused expansion conv)
    [
        ("efficientnet_b0_cifar", 3_598_598, 320),
        ("mobilenetv2_cifar", 2_296_922, 1280),
        ("googlenet_cifar", 6_166_250, 1024),
    ],
)
def test_fccl_cifar_sizes(name: str, params: int, features: int) -> None:
    """The FCCL+ CIFAR models have the expected parameter counts, feature sizes and linear heads."""
    model = create_model(name, num_classes=10, seed=0)
    assert sum(p.numel() for p in model.parameters()) == params
    assert model.num_features == features and isinstance(model.head, nn.Linear)


CONTRACT_CASES = [("efficientnet_b0_cifar", 32), ("mobilenetv2_cifar", 32), ("googlenet_cifar", 16)]


@pytest.mark.parametrize(("name", "size"), CONTRACT_CASES)
def test_fccl_cifar_contract(name: str, size: int) -> None:
    """GoogLeNet-CIFAR costs ~2 s at 32x32 on one core, so it runs at 16x16 (adaptive pooling)."""
    model = create_model(name, num_classes=NUM_CLASSES, seed=0)
    _contract(model, torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0)))


def test_cifar_stems_keep_resolution() -> None:
    """The CIFAR variants downsample 32x32 to 4x4 (MobileNetV2 / EfficientNet) or 8x8 (GoogLeNet), not 1x1."""
    x = torch.zeros(1, 3, 32, 32)
    mobilenet = create_model("mobilenetv2_cifar", NUM_CLASSES, seed=0).eval()
    googlenet = create_model("googlenet_cifar", NUM_CLASSES, seed=0).eval()
    efficientnet = create_model("efficientnet_b0_cifar", NUM_CLASSES, seed=0).eval()
    with torch.no_grad():
        assert mobilenet.features(x).shape == (1, 1280, 4, 4)
        assert googlenet.features(x).shape == (1, 1024, 8, 8)
        assert efficientnet.blocks(efficientnet.stem(x)).shape == (1, 320, 2, 2)


def test_efficientnet_drop_connect_schedule_and_code_option() -> None:
    """EfficientNet's drop-connect grows linearly per block, can be turned off, and only acts in training."""
    model = create_model("efficientnet_b0_cifar", NUM_CLASSES, seed=0)
    rates = [block.drop_rate for block in model.blocks]
    assert len(rates) == 16 and rates[0] == 0.0 and rates[-1] == pytest.approx(0.2 * 15 / 16)
    code = create_model("efficientnet_b0_cifar", NUM_CLASSES, seed=0, drop_connect_rate=0.0)
    assert all(block.drop_rate == 0.0 for block in code.blocks)
    # dropout lives in forward_features in training mode (FCCL+'s features()), not in eval mode
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    code.eval()
    with torch.no_grad():
        torch.testing.assert_close(code.forward_features(x), code.forward_features(x))
        code.train()
        torch.manual_seed(0)
        dropped = code.forward_features(x)
    assert (dropped == 0).float().mean() > 0.05


def test_client_models_of_fccl_digits_differ_per_client() -> None:
    """Two clients of one architecture get different initialisations."""
    family = resolve_family("fccl_digits")
    efficientnet = create_client_model(family, client_id=2, num_classes=10, seed=0)
    again = create_client_model(family, client_id=6, num_classes=10, seed=0)  # same architecture, other client
    assert type(efficientnet) is type(again)
    assert not torch.equal(efficientnet.head.weight, again.head.weight)


def test_vit_image_size_is_validated_before_building() -> None:
    """A ViT refuses an image size that is not a multiple of its patch size."""
    with pytest.raises(ConfigError, match="multiple of 16"):
        create_model("vit_b_16", NUM_CLASSES, image_size=24)
    with pytest.raises(ConfigError, match="multiple of 32"):
        create_model("vit_b_32", NUM_CLASSES, image_size=16)


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("FEDHET_HEAVY_TESTS") != "1",
    reason="builds an 88M-parameter ViT (~5-15 s on the shared CPUs); set FEDHET_HEAVY_TESTS=1 to run",
)
def test_vit_b_32_contract_grey_input_and_shared_feature_dim() -> None:
    """ViT-B/32 (88M parameters, ~4 s to build on one core) once: the cheapest ViT, one 32x32 patch.

    ViT-B/16 is the same torchvision class with a smaller patch; the registry contract test
    (tests/models/test_models.py) builds both at 32x32.
    """
    model = create_model("vit_b_32", NUM_CLASSES, in_channels=1, seed=0, feature_dim=512)
    assert model.num_backbone_features == 768 and model.num_features == 512
    assert model.head.weight.shape == (NUM_CLASSES, 512)  # HtFLlib's shared 512-d head input
    assert model.body.conv_proj.in_channels == 1
    _contract(model, torch.randn(2, 1, 32, 32, generator=torch.Generator().manual_seed(0)))
