"""Local: every client trains on its own data only (the lower bound of every table).

Paper: none; the "Local" / "BASE" row of HtFLlib, FedKTL (Table 1) and FCCL+ (Tables VIII-IX).

Upload: nothing. Download: nothing.
Server phase: none.
Client state kept across rounds: the local model and its optimizer state.
Deviations from paper/official code: none (HtFLlib's Local also trains with plain cross-entropy).
"""

from __future__ import annotations

from fedhet.algorithms.base import Algorithm, Capabilities, OptimizerName
from fedhet.hparams import Momentum, NonNegativeFloat, PositiveFloat


class Local(Algorithm):
    """No collaboration: a round is ``max_epochs`` more local epochs.

    Args:
        optimizer: local optimizer, ``"sgd"``, ``"adam"`` or ``"adamw"``.
        lr: local learning rate.
        momentum: SGD momentum.
        weight_decay: L2 weight decay.
    """

    capabilities = Capabilities(heterogeneous_models=True)

    def __init__(
        self,
        optimizer: OptimizerName = "sgd",
        lr: PositiveFloat = 0.01,
        momentum: Momentum = 0.0,
        weight_decay: NonNegativeFloat = 0.0,
    ) -> None:
        # Same as Algorithm's; restated so that the parser checks the ranges of these values.
        super().__init__(optimizer, lr, momentum, weight_decay)
