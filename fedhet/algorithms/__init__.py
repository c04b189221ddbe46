"""Registered federated methods. ``list_algorithms()`` is what the contract test iterates."""

from __future__ import annotations

import difflib

from fedhet.algorithms.base import (
    Algorithm,
    Capabilities,
    ClientModule,
    CollaborativePhase,
    LocalStage,
    RefineStage,
    RunPhase,
    ServerPhase,
    ServerPlugin,
    ServerRefinement,
    TrainableServerPhase,
)
from fedhet.algorithms.ccvr import CCVR
from fedhet.algorithms.ditto import Ditto
from fedhet.algorithms.fccl import FCCL
from fedhet.algorithms.fccl_plus import FCCLPlus
from fedhet.algorithms.fd import FD
from fedhet.algorithms.fedavg import FedAvg
from fedhet.algorithms.fedbn import FedBN
from fedhet.algorithms.fedcg import FedCG
from fedhet.algorithms.feddf import FedDF
from fedhet.algorithms.feddf_server import FedDFServer
from fedhet.algorithms.feddyn import FedDyn
from fedhet.algorithms.fedftg import FedFTG
from fedhet.algorithms.fedgen import FedGen
from fedhet.algorithms.fedgh import FedGH
from fedhet.algorithms.fedkd import FedKD
from fedhet.algorithms.fedktl import FedKTL
from fedhet.algorithms.fedl2g import FedL2GFeat, FedL2GLogit
from fedhet.algorithms.fedmatch import FedMatch
from fedhet.algorithms.fedmd import FedMD
from fedhet.algorithms.fedmdcg import FedMDCG, PaperProtocol
from fedhet.algorithms.fedmrl import FedMRL
from fedhet.algorithms.fedper import FedPer
from fedhet.algorithms.fedproc import FedProc
from fedhet.algorithms.fedproto import FedProto
from fedhet.algorithms.fedprox import FedProx
from fedhet.algorithms.fedrs import FedRS
from fedhet.algorithms.fedtgp import FedTGP
from fedhet.algorithms.fedtype import FedType
from fedhet.algorithms.fedvtc import FedVTC
from fedhet.algorithms.fml import FML
from fedhet.algorithms.lg_fedavg import LGFedAvg
from fedhet.algorithms.local import Local
from fedhet.algorithms.moon import MOON
from fedhet.algorithms.rhfl import RHFL
from fedhet.algorithms.scaffold import SCAFFOLD
from fedhet.errors import ConfigError

#: Registry: config name -> Algorithm class. Names are the experiment config file names.
ALGORITHMS: dict[str, type[Algorithm]] = {
    "local": Local,
    "fedavg": FedAvg,
    "fedprox": FedProx,
    "feddyn": FedDyn,
    "scaffold": SCAFFOLD,
    "fedproto": FedProto,
    "moon": MOON,
    "fedproc": FedProc,
    "fedrs": FedRS,
    "fd": FD,
    "fedmd": FedMD,
    "feddf": FedDF,
    "feddf_server": FedDFServer,
    "fedftg": FedFTG,
    "rhfl": RHFL,
    "fedmatch": FedMatch,
    "fccl": FCCL,
    "fccl_plus": FCCLPlus,
    "fedgen": FedGen,
    "fml": FML,
    "fedkd": FedKD,
    "lg_fedavg": LGFedAvg,
    "fedgh": FedGH,
    "fedtgp": FedTGP,
    "fedktl": FedKTL,
    "fedper": FedPer,
    "fedcg": FedCG,
    "fedmdcg": FedMDCG,
    "fedvtc": FedVTC,
    "ccvr": CCVR,
    "fedtype": FedType,
    "fedbn": FedBN,
    "ditto": Ditto,
    "fedmrl": FedMRL,
    "fedl2g_feat": FedL2GFeat,
    "fedl2g_logit": FedL2GLogit,
}

# A server plugin configured without a base refines FedAvg; set here, where both are imported, so
# that the contract (base.py) imports no method.
ServerPlugin.default_base = FedAvg


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
    "Algorithm",
    "CCVR",
    "Capabilities",
    "ClientModule",
    "CollaborativePhase",
    "Ditto",
    "FCCL",
    "FCCLPlus",
    "FD",
    "FML",
    "FedAvg",
    "FedBN",
    "FedCG",
    "FedDF",
    "FedDFServer",
    "FedFTG",
    "FedDyn",
    "FedGH",
    "FedGen",
    "FedKD",
    "FedKTL",
    "FedL2GFeat",
    "FedL2GLogit",
    "FedMD",
    "FedMDCG",
    "FedMRL",
    "FedMatch",
    "FedPer",
    "FedProc",
    "FedProto",
    "FedProx",
    "FedRS",
    "FedTGP",
    "FedType",
    "FedVTC",
    "LGFedAvg",
    "Local",
    "LocalStage",
    "MOON",
    "PaperProtocol",
    "RHFL",
    "RefineStage",
    "RunPhase",
    "SCAFFOLD",
    "ServerPhase",
    "ServerPlugin",
    "ServerRefinement",
    "TrainableServerPhase",
    "get_algorithm",
    "list_algorithms",
]
