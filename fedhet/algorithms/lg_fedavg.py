"""LG-FedAvg: local representations, a global classifier head averaged FedAvg-style.

Paper: Liang et al., "Think Locally, Act Globally: Federated Learning with Local and Global
Representations", arXiv:2001.01523, 2020 (Algorithm 1). Heterogeneous form and
defaults of HtFLlib (``serverlg.py`` / ``clientlg.py``), the implementation FedKTL's Table 1 ran
(no method hyperparameters, FedKTL App. C).

Upload: the client's classifier head ``nn.Linear(K', C)`` (``WeightsPayload``): ``K'*C + C``
floats (FedKTL Table 5), with the client's number of training examples.
Download: the averaged head, from the end of round 0 on (before that clients keep their own).
Server phase: closed-form, ``head <- sum_k n_k / n * head_k`` over the round's participants
(:func:`fedhet.functional.weighted_average`, HtFLlib's ``uploaded_weights``).
Client state kept across rounds: the whole model (the feature extractor never leaves the
client) and its optimizer state; the head is overwritten by each download.
Local objective: cross-entropy on the whole model.
Deviations from paper/official code: the paper's global part is the top layers chosen per
architecture; heterogeneous backbones share only the final linear head, as in HtFLlib (every
backbone emits ``feature_dim`` features; fedhet's ``feature_proj`` picks HtFLlib's pooling or a
linear neck).
"""

from __future__ import annotations

from fedhet.algorithms.base import (
    Algorithm,
    Capabilities,
    ServerPhase,
)
from fedhet.algorithms.shared.common import HEAD_PREFIX, SubmoduleAveragingServer, SubmoduleSharingClient
from fedhet.core.payloads import WeightsPayload


class LGFedAvgClient(SubmoduleSharingClient):
    """Cross-entropy locally; swaps the global head into its own model at each round start."""

    shared_module = "model.head"


class LGFedAvgServer(SubmoduleAveragingServer):
    """Holds the global head; aggregates the participants' heads by example-weighted averaging.

    Client 0's initial head only fixes the expected keys and shapes; it is never sent: clients keep
    their own head until the first average exists.
    """

    def __init__(self) -> None:
        super().__init__("model." + HEAD_PREFIX, per_architecture=False, send_initial=False)


class LGFedAvg(Algorithm):
    """LG-FedAvg in HtFLlib's heterogeneous form (shared head; needs one feature dimension)."""

    client_type = LGFedAvgClient
    capabilities = Capabilities(heterogeneous_models=True, common_feature_dim=True)
    upload_type = WeightsPayload
    download_type = WeightsPayload

    def build_server(self) -> ServerPhase:
        return LGFedAvgServer()
