"""Registered federated methods. ``list_algorithms()`` is what the contract test iterates."""

from __future__ import annotations

import difflib

from fedhet.algorithms.base import Algorithm, Capabilities, ClientModule, CollaborativePhase, ServerPhase, TrainableServerPhase
from fedhet.algorithms.fd import FD
from fedhet.algorithms.fedavg import FedAvg
from fedhet.algorithms.fedprox import FedProx
from fedhet.algorithms.fedproto import FedProto
from fedhet.algorithms.local import Local
from fedhet.errors import ConfigError

#: Registry: config name -> Algorithm class. Names are the experiment config file names.
ALGORITHMS: dict[str, type[Algorithm]] = {
    "local": Local,
    "fedavg": FedAvg,
    "fedprox": FedProx,
    "fedproto": FedProto,
    "fd": FD,
}


def list_algorithms() -> list[str]:
    """Names of the registered methods."""
    return sorted(ALGORITHMS)


def get_algorithm(name: str) -> type[Algorithm]:
    """The method class registered as ``name`` (case-insensitive)."""
    key = name.lower()
    if key not in ALGORITHMS:
        close = difflib.get_close_matches(key, ALGORITHMS, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(f"unknown method '{name}'{hint}; known methods: {', '.join(list_algorithms())}")
    return ALGORITHMS[key]


__all__ = [
    "ALGORITHMS",
    "FD",
    "Algorithm",
    "Capabilities",
    "ClientModule",
    "CollaborativePhase",
    "FedAvg",
    "FedProto",
    "FedProx",
    "Local",
    "ServerPhase",
    "TrainableServerPhase",
    "get_algorithm",
    "list_algorithms",
]
