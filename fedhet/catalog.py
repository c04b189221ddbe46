"""The registered names (methods, models, model families) as static data, readable without torch.

The real registries (:data:`fedhet.algorithms.ALGORITHMS`, :func:`fedhet.models.list_models`)
live in modules that import torch, Lightning and every method: several seconds before a single
name can be printed. ``fedhet list`` and the command line's name checks (``--method fccl_plus``,
did-you-mean on a typo) only need the names, so they read this table instead;
``tests/test_cli_names.py`` checks that it equals the real registries, so a method or model added
there without an entry here fails the tests rather than going missing from ``fedhet list``.
"""

from __future__ import annotations

import difflib
from pathlib import Path

import yaml

from fedhet.errors import ConfigError

#: Method registry name -> class path (``fedhet.algorithms.ALGORITHMS``, in its order).
METHODS: dict[str, str] = {
    "local": "fedhet.algorithms.Local",
    "fedavg": "fedhet.algorithms.FedAvg",
    "fedprox": "fedhet.algorithms.FedProx",
    "feddyn": "fedhet.algorithms.FedDyn",
    "scaffold": "fedhet.algorithms.SCAFFOLD",
    "fedproto": "fedhet.algorithms.FedProto",
    "moon": "fedhet.algorithms.MOON",
    "fedproc": "fedhet.algorithms.FedProc",
    "fedrs": "fedhet.algorithms.FedRS",
    "fd": "fedhet.algorithms.FD",
    "fedmd": "fedhet.algorithms.FedMD",
    "feddf": "fedhet.algorithms.FedDF",
    "feddf_server": "fedhet.algorithms.FedDFServer",
    "fedftg": "fedhet.algorithms.FedFTG",
    "rhfl": "fedhet.algorithms.RHFL",
    "fedmatch": "fedhet.algorithms.FedMatch",
    "fccl": "fedhet.algorithms.FCCL",
    "fccl_plus": "fedhet.algorithms.FCCLPlus",
    "fedgen": "fedhet.algorithms.FedGen",
    "fml": "fedhet.algorithms.FML",
    "fedkd": "fedhet.algorithms.FedKD",
    "lg_fedavg": "fedhet.algorithms.LGFedAvg",
    "fedgh": "fedhet.algorithms.FedGH",
    "fedtgp": "fedhet.algorithms.FedTGP",
    "fedktl": "fedhet.algorithms.FedKTL",
    "fedper": "fedhet.algorithms.FedPer",
    "fedcg": "fedhet.algorithms.FedCG",
    "fedmdcg": "fedhet.algorithms.FedMDCG",
    "fedvtc": "fedhet.algorithms.FedVTC",
    "ccvr": "fedhet.algorithms.CCVR",
    "fedtype": "fedhet.algorithms.FedType",
    "fedbn": "fedhet.algorithms.FedBN",
    "ditto": "fedhet.algorithms.Ditto",
}

#: Registered model names (``fedhet.models.list_models()``).
MODELS: tuple[str, ...] = (
    "cnn_tiny",
    "efficientnet_b0",
    "efficientnet_b0_cifar",
    "fedavg_cnn",
    "ftg_cnn",
    "ftg_cnn_bn",
    "googlenet",
    "googlenet_cifar",
    "lenet5",
    "logreg",
    "mlp_tiny",
    "mlp_vector",
    "mobilenet_v2",
    "mobilenetv2_cifar",
    "mobilenetv2_tiny",
    "resnet10",
    "resnet101",
    "resnet10_cifar",
    "resnet10_tiny",
    "resnet12_cifar",
    "resnet12_tiny",
    "resnet152",
    "resnet18",
    "resnet18_cifar",
    "resnet34",
    "resnet34_cifar",
    "resnet4",
    "resnet50",
    "resnet6",
    "resnet8",
    "shufflenet_v2",
    "simple_cnn",
    "vit_b_16",
    "vit_b_32",
)

_CLASS_NAMES = {path.rsplit(".", 1)[1]: path for path in METHODS.values()}


def list_methods() -> list[str]:
    """Sorted method registry names (what ``--method`` and ``method:`` accept)."""
    return sorted(METHODS)


def list_families() -> list[str]:
    """Sorted model family names, read from ``fedhet/models/families.yaml`` (the families' source)."""
    # Read by file path: importing the fedhet.models package would import torch.
    text = (Path(__file__).parent / "models" / "families.yaml").read_text(encoding="utf-8")
    return sorted(yaml.safe_load(text) or {})


def unknown_method_message(name: str) -> str:
    """The one-line error for an unknown method name, with did-you-mean and the list of methods."""
    close = difflib.get_close_matches(name.lower(), METHODS, n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return f"unknown method '{name}'{hint}; known methods: {', '.join(list_methods())}"


def method_class_path(name: str) -> str:
    """The class path for a method given as a registry name (any case), class name or class path.

    Raises:
        ConfigError: ``name`` is none of those (one line with did-you-mean and the methods).
    """
    if name.lower() in METHODS:
        return METHODS[name.lower()]
    if name in _CLASS_NAMES:
        return _CLASS_NAMES[name]
    if "." in name:  # a class path, checked by the parser (it may name a user's own method)
        return name
    raise ConfigError(unknown_method_message(name))
