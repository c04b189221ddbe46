"""The layer beneath the method contract and the round loop: payloads and state helpers.

``fedhet.algorithms`` (the contract and the methods) and ``fedhet.federation`` (the loop) both
import from here and never from each other's internals, so the package graph has no cycle.
"""

from fedhet.core.payloads import ClassStatsPayload, Payload, WeightsPayload, check_like, check_shape
from fedhet.core.state import atomic_torch_save, clone_state, copy_state_into, safe_torch_load

__all__ = [
    "ClassStatsPayload",
    "Payload",
    "WeightsPayload",
    "atomic_torch_save",
    "check_like",
    "check_shape",
    "clone_state",
    "copy_state_into",
    "safe_torch_load",
]
