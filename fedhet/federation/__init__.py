"""The round loop, client state stores, executors and the communication ledger.

Everything here sits above the method contract (:mod:`fedhet.algorithms.base`) and the shared
layer beneath it (:mod:`fedhet.core`: payloads and state helpers), so imports are plain.
"""

from fedhet.core.payloads import ClassStatsPayload, Payload, WeightsPayload
from fedhet.federation.aggregation import Aggregator
from fedhet.federation.executors import EXECUTORS, Executor, ProcessExecutor, SequentialExecutor
from fedhet.federation.ledger import CommunicationLedger
from fedhet.federation.loop import FederationLoop, check_compatibility
from fedhet.federation.lr_schedule import LRSchedule
from fedhet.federation.ray_executor import RayExecutor  # imports Ray only when one is built
from fedhet.federation.runtime import ClientResult, ClientRuntime, ClientTask, RuntimeRecipe
from fedhet.federation.settings import FederationSettings
from fedhet.federation.state import ClientStateStore, DiskStateStore, MemoryStateStore
from fedhet.federation.trainer import ServerTrainerTemplate, TrainerTemplate

__all__ = [
    "EXECUTORS",
    "Aggregator",
    "ClassStatsPayload",
    "ClientResult",
    "ClientRuntime",
    "ClientStateStore",
    "ClientTask",
    "CommunicationLedger",
    "DiskStateStore",
    "Executor",
    "FederationLoop",
    "FederationSettings",
    "LRSchedule",
    "MemoryStateStore",
    "Payload",
    "ProcessExecutor",
    "RayExecutor",
    "RuntimeRecipe",
    "SequentialExecutor",
    "ServerTrainerTemplate",
    "TrainerTemplate",
    "WeightsPayload",
    "check_compatibility",
]
