"""The round loop, client state, payloads, executors and the communication ledger.

Names are imported lazily: method files import :mod:`fedhet.federation.payloads` while the loop
imports the method contract, and lazy access keeps that from becoming an import cycle.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EXECUTORS": "executors",
    "Executor": "executors",
    "SequentialExecutor": "executors",
    "CommunicationLedger": "ledger",
    "FederationLoop": "loop",
    "check_compatibility": "loop",
    "ClassStatsPayload": "payloads",
    "Payload": "payloads",
    "WeightsPayload": "payloads",
    "ClientResult": "runtime",
    "ClientRuntime": "runtime",
    "ClientTask": "runtime",
    "ClientStateStore": "state",
    "DiskStateStore": "state",
    "MemoryStateStore": "state",
    "TrainerTemplate": "trainer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fedhet.federation' has no attribute {name!r}")
    return getattr(importlib.import_module(f"fedhet.federation.{_EXPORTS[name]}"), name)
