"""Local: every client trains on its own data only (the lower bound of every table).

Paper: none; the "Local" / "BASE" row of HtFLlib, FedKTL (Table 1) and FCCL+ (Tables VIII-IX).

Upload: nothing. Download: nothing.
Server phase: none.
Client state kept across rounds: the local model and its optimizer state.
Deviations from paper/official code: none (HtFLlib's Local also trains with plain cross-entropy).
"""

from __future__ import annotations

from fedhet.algorithms.base import Algorithm, Capabilities


class Local(Algorithm):
    """No collaboration: a round is ``max_epochs`` more local epochs (the shared local optimizer's knobs)."""

    capabilities = Capabilities(heterogeneous_models=True)
