"""FedAvg: weighted averaging of whole models.

Paper: McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized
Data", AISTATS 2017 (Algorithm 1, FederatedAveraging).

Upload: the client's model weights (``WeightsPayload``) and its number of training examples.
Download: the global model weights.
Server phase: closed-form, ``w <- sum_k n_k / n * w_k`` over the round's participants of each
architecture
(:func:`fedhet.functional.weighted_average`), BatchNorm buffers included.
Client state kept across rounds: its optimizer state (momentum), when
``federation.persist_optimizer_state`` is on; the weights are overwritten by each download.
Deviations from paper/official code: the global model starts from client 0's initialisation
(the paper only needs a common start); integer buffers (``num_batches_tracked``) are averaged
and rounded rather than left undefined.
"""

from __future__ import annotations

from fedhet.algorithms.shared.common import FedAvgClient, FedAvgServer, WeightAveraging


class FedAvg(WeightAveraging):
    """FedAvg (homogeneous models only); its hyperparameters are the shared local optimizer's."""


__all__ = ["FedAvg", "FedAvgClient", "FedAvgServer"]
