"""FedDyn: federated learning with dynamic regularisation (a linear and a quadratic local penalty).

Paper: Acar et al., "Federated Learning Based on Dynamic Regularization", ICLR 2021, Algorithm 1.
With ``theta^{t-1}`` the global model of the last round, ``P_t`` the round's participants and
``m`` the number of all clients:

* client ``k`` in ``P_t`` (the local problem):
  ``theta_k^t = argmin_theta L_k(theta) - <grad L_k(theta_k^{t-1}), theta> + alpha/2 ||theta - theta^{t-1}||^2``,
  approximated by the configured local budget of the local optimizer;
* its gradient state (the state update):
  ``grad L_k(theta_k^t) = grad L_k(theta_k^{t-1}) - alpha (theta_k^t - theta^{t-1})``, from 0;
* server (the server update): ``h^t = h^{t-1} - alpha (1/m) sum_{k in P_t} (theta_k^t - theta^{t-1})``
  from ``h^0 = 0``, then ``theta^t = (1/|P_t|) sum_{k in P_t} theta_k^t - (1/alpha) h^t``.

The state update is the first-order optimality condition of the local problem's exact
minimiser, so after an exactly solved local problem the state *is* the local gradient there
(tested), and ``h^t`` stays ``(1/m) sum_k grad L_k(theta_k^t)`` over all clients (tested).
``alpha = 0.01``: FedFTG's setting (reference/fedftg.md sec. 3) and ``alpha_coef`` of the official
example (github.com/alpemreacar/FedDyn, ``example_cifar_10.py``).

Upload: the client's model weights (``WeightsPayload``, BatchNorm buffers included) and its number
of examples.
Download: the global model weights ``theta^t``.
Server phase: closed form, the two lines above on the model's parameters, per architecture
(:class:`FedDynServer`, a :class:`FedAvgServer` with a uniform mean and the state ``h``);
``acc_server`` evaluates ``theta^t``.
Client state kept across rounds: the gradient state ``grad L_k(theta_k)`` (one buffer per
parameter, :class:`ParameterBuffers` ``gradient_state``) and the optimizer state; the weights are
overwritten by each download, and the regulariser's centre ``theta^{t-1}`` is the download.
Deviations from paper/official code:

* buffers (BatchNorm running statistics, ``num_batches_tracked``) are not optimisation variables:
  the server averages them uniformly over the participants (integers rounded) without the ``h``
  correction (the paper does not discuss BatchNorm; the FedFTG code, built on FedDyn's, averages
  the whole state dict);
* one ``alpha`` for every client as in Algorithm 1; the official code scales it per client,
  ``alpha / w_k`` with ``w_k = n_k m / n`` (clients with more data are regularised less);
* the local problem is solved inexactly (the configured epochs or steps of the local optimizer,
  as the official code does with SGD); optimizer weight decay, if set, is added on top;
* the logged ``train/loss`` is the whole local objective (cross-entropy plus the two penalties),
  which may be negative.

Step size (``docs/diagnoses.md``): the server update ``theta^t = mean - h^t / alpha`` extrapolates
past the participants' mean (with full participation the first round's step is twice FedAvg's,
for any ``alpha``), so FedDyn diverges at local steps FedAvg tolerates: on ``digits_dir`` momentum
0.9 at lr 0.05 ends near chance for every ``alpha`` in {0.001, 0.01, 0.1}, while plain SGD at
lr 0.05 beats FedAvg at the same optimizer. ``momentum``, ``lr`` and ``alpha`` are declared with
search spaces so the tuning stage can pick the pair.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhet.algorithms.base import Batch, ClientUpload, ServerPhase
from fedhet.algorithms.shared.common import (
    CorrectedAverageServer,
    FedAvgClient,
    ParameterBuffers,
    WeightAveraging,
)
from fedhet.core.payloads import Payload, WeightsPayload
from fedhet.functional import linear_term, proximal_term
from fedhet.hparams import Hyperparameters, LocalOptimizer, Momentum, PositiveFloat, categorical, knob, log_uniform

#: Where a FedDyn client keeps ``grad L_k(theta_k)`` in its state dict.
GRADIENT_STATE = "gradient_state"


@dataclass(frozen=True)
class FedDynHparams(LocalOptimizer):
    """FedDyn's hyperparameters: the local optimizer and ``alpha`` (clients and server read the same one)."""

    momentum: Momentum = knob(
        0.0,
        "SGD momentum (the official code: none); searched with lr and alpha: FedDyn's server step "
        "diverges at large effective local steps (momentum 0.9 on digits_dir, docs/diagnoses.md)",
        categorical(0.0, 0.5, 0.9),
    )
    alpha: PositiveFloat = knob(
        0.01,
        "dynamic regularisation coefficient (> 0: the server divides by it; FedFTG and the official code: 0.01)",
        log_uniform(1e-3, 1.0),
    )


class FedDynClient(FedAvgClient):
    """Cross-entropy minus ``<grad L_k(theta_k^{t-1}), theta>`` plus ``alpha/2 ||theta - theta^{t-1}||^2``.

    The gradient state is a declared buffer per parameter (``gradient_state``), updated once at
    the end of each local update (``on_train_end``) by Algorithm 1's state update.
    """

    Hparams = FedDynHparams
    training_only_state = ("gradient_state",)

    def __init__(self, model: nn.Module, num_classes: int, hp: Any = None, **overrides: Any) -> None:
        super().__init__(model, num_classes, hp, **overrides)
        self.gradient_state = ParameterBuffers(model)
        self.reference: list[Tensor] = []

    def load_client_state(self, state: Mapping[str, Tensor]) -> None:
        super().load_client_state(state)
        self.reference = []  # the live module is shared by clients: no centre until this client's download

    def on_receive(self, download: Payload | None) -> None:
        super().on_receive(download)
        self.reference = (
            [p.detach().clone() for p in self.model.parameters()] if isinstance(download, WeightsPayload) else []
        )

    def on_fit_start(self) -> None:
        self.reference = [r.to(self.device) for r in self.reference]

    def local_loss(self, batch: Batch) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        if self.reference:
            params = list(self.model.parameters())
            loss = (
                loss
                - linear_term(params, self.gradient_state.tensors())
                + self.hp.alpha / 2 * proximal_term(params, self.reference)
            )
        return loss

    @torch.no_grad()
    def update_gradient_state(self) -> None:
        """``grad L_k(theta_k^t) = grad L_k(theta_k^{t-1}) - alpha (theta_k^t - theta^{t-1})`` (Alg. 1)."""
        if not self.reference:
            return  # purely local training (no download this step): Algorithm 1 has no such step
        for state, param, reference in zip(
            self.gradient_state.tensors(), self.model.parameters(), self.reference, strict=True
        ):
            state.sub_(self.hp.alpha * (param - reference.to(param.device)))

    def on_train_end(self) -> None:
        self.update_gradient_state()


class FedDynServer(CorrectedAverageServer):
    """FedDyn's server: ``h`` and the corrected mean of Algorithm 1's server update, per architecture.

    The mean is uniform over the round's participants (``1/|P_t|``), ``h`` (:attr:`state_by_architecture`)
    divides by the number of all clients of the architecture (``m``); buffers are averaged without
    correction. It reads the clients' ``alpha``.
    """

    Hparams: ClassVar[type[Hyperparameters]] = FedDynHparams
    state_prefix = GRADIENT_STATE
    state_key = "h_by_architecture"
    method_name = "FedDyn"

    def correct(
        self,
        state: dict[str, Tensor],
        model: dict[str, Tensor],
        previous: Mapping[str, Tensor],
        members: Sequence[ClientUpload],
        clients: int,
    ) -> None:
        for name, h_old in state.items():
            drift = torch.stack([u.payload.weights[name].double() for u in members]).sum(0)  # type: ignore[attr-defined]
            drift = drift - len(members) * previous[name].double()  # sum_{k in P_t} (theta_k - theta^{t-1})
            h_new = h_old.double() - self.hp.alpha / clients * drift
            state[name] = h_new.to(h_old.dtype)
            model[name] = (model[name].double() - h_new / self.hp.alpha).to(model[name].dtype)


class FedDyn(WeightAveraging):
    """FedDyn (homogeneous models only)."""

    Hparams = FedDynHparams
    client_type = FedDynClient

    def build_server(self) -> ServerPhase:
        return FedDynServer(self.hp)


__all__ = ["FedDyn", "FedDynClient", "FedDynHparams", "FedDynServer"]
