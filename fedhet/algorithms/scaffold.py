"""SCAFFOLD: local SGD corrected by control variates (option II).

Paper: Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning",
ICML 2020, Algorithm 1 with option II of the control-variate update. With ``x`` the server
model, ``c`` the server control variate, ``c_i`` client ``i``'s (all from 0), ``S`` the round's
participants, ``N`` all clients, ``eta_l`` the local and ``eta_g`` the global learning rate:

* client: ``y_i <- x``; ``K`` steps ``y_i <- y_i - eta_l (g_i(y_i) - c_i + c)``;
  ``c_i^+ = c_i - c + (x - y_i) / (K eta_l)`` (option II); upload
  ``(Delta y_i, Delta c_i) = (y_i - x, c_i^+ - c_i)``; ``c_i <- c_i^+``;
* server: ``x <- x + eta_g (1/|S|) sum_{i in S} Delta y_i`` and
  ``c <- c + (|S|/N) (1/|S|) sum_{i in S} Delta c_i``.

The correction ``c - c_i`` is added to every parameter's gradient in ``on_before_optimizer_step``,
after the (accumulated, unscaled) backward pass and before Lightning's gradient clipping and the
optimizer step, so it works in the lean Trainer the runtime builds. ``K eta_l`` is measured as the
sum of the learning rates of the steps actually taken (``K eta_l`` for a constant rate).

Upload: the local model ``y_i`` (whole ``state_dict``, BatchNorm buffers included; the server
forms ``Delta y_i = y_i - x``, the same bytes) and ``Delta c_i`` (one tensor per parameter):
about twice FedAvg's upload, as the paper notes (:class:`ScaffoldPayload`).
Download: ``x`` and ``c``, again about twice the model.
Server phase: closed form, the two lines above per architecture (:class:`ScaffoldServer`, a
:class:`FedAvgServer` with a uniform mean, the global step and ``c``); ``acc_server`` evaluates ``x``.
Client state kept across rounds: ``c_i`` (one buffer per parameter, :class:`ParameterBuffers`
``control_variate``); the weights are overwritten by each download; plain SGD keeps no
optimizer state.
Optimizer: plain SGD only (``momentum = 0``; ``ConfigError`` otherwise). Option II reads the
average corrected gradient off the displacement, ``(x - y_i) / (K eta_l)``, which holds for plain
SGD steps; heavy-ball momentum ``beta`` stretches the displacement by about ``1 / (1 - beta)`` (10x
at 0.9) and Adam's steps are not ``eta_l g`` at all, so ``c_i`` would no longer estimate the
client's gradient. Weight decay is allowed: it is part of ``g_i`` and so of ``c_i``.
Deviations from paper/official code:

* buffers (BatchNorm running statistics, ``num_batches_tracked``) are not optimisation variables:
  they are averaged uniformly over the participants (integers rounded), with no global step and no
  control variate (the FedFTG code also skips BN buffers in the correction);
* a client that took no step this round keeps its ``c_i`` (``Delta c_i = 0``): option II is
  undefined for ``K = 0``;
* the mean of ``Delta y_i`` is uniform, as in Algorithm 1 and the SCAFFOLD of the FedDyn code
  base behind FedFTG (github.com/alpemreacar/FedDyn, ``train_SCAFFOLD``); that code also corrects
  with ``c / w_i - c_i`` and adds ``w_i Delta c_i`` to ``c`` (``w_i = n_i N / n``, 1 for equal
  client sizes), fixes ``K`` to a number of mini-batches and divides by the undecayed ``eta_l``;
  here ``K eta_l`` is what the local budget actually took;
* ``x`` in the ``c_i`` update is the model the client received (after any server refinement),
  not the previous plain average (reference/fedftg.md A9).

Step size (``docs/diagnoses.md``): plain SGD at a folder's lr takes about a tenth of the steps of
the momentum-0.9 configs beside it; on ``digits_dir`` SCAFFOLD at lr 0.05 tracks FedAvg with
momentum 0 at lr 0.05 (no bug), and lr 0.5 (about momentum 0.9's effective step) brings it to
FedAvg's level. ``lr`` (searched log-uniformly in [1e-4, 1]) is the knob to tune, not momentum.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from fedhet.algorithms.base import Batch, ClientUpload, ServerPhase
from fedhet.algorithms.shared.common import (
    CorrectedAverageServer,
    FedAvgClient,
    ParameterBuffers,
    WeightAveraging,
)
from fedhet.core.payloads import Payload, WeightsPayload, check_like
from fedhet.core.state import clone_state
from fedhet.errors import ConfigError
from fedhet.hparams import Hyperparameters, LocalOptimizer, PositiveFloat, knob, log_uniform

#: Where a SCAFFOLD client keeps ``c_i`` in its state dict.
CONTROL_VARIATE = "control_variate"


@dataclass(frozen=True)
class ScaffoldHparams(LocalOptimizer):
    """SCAFFOLD's hyperparameters: the local optimizer (plain SGD only, see the module docstring) and ``eta_g``."""

    global_lr: PositiveFloat = knob(
        1.0,
        "server step size eta_g (1: the participants' mean, the paper's and FedFTG's setting)",
        log_uniform(0.1, 10.0),
    )

    def check(self) -> None:
        if self.optimizer != "sgd":
            raise ConfigError(
                f"the control variates correct SGD steps: set method.optimizer=sgd (got {self.optimizer!r})"
            )
        if self.momentum != 0:
            raise ConfigError(
                f"option II control variates assume plain SGD: set method.momentum=0 (got {self.momentum})"
            )


@dataclass(frozen=True)
class ScaffoldPayload(WeightsPayload):
    """Model weights plus one control-variate tensor per parameter.

    Download: ``weights`` = the server model ``x``, ``control`` = ``c``. Upload: ``weights`` = the
    local model ``y_i``, ``control`` = ``Delta c_i``. Both fields are counted by :meth:`nbytes`.
    """

    control: dict[str, Tensor] = dataclasses.field(default_factory=dict)


class ScaffoldClient(FedAvgClient):
    """Cross-entropy with every SGD step's gradient corrected by ``c - c_i``; option II update of ``c_i``."""

    Hparams = ScaffoldHparams
    training_only_state = ("control_variate",)

    def __init__(self, model: nn.Module, num_classes: int, hp: Any = None, **overrides: Any) -> None:
        super().__init__(model, num_classes, hp, **overrides)
        self.control_variate = ParameterBuffers(model)
        self._reset_round()

    def _reset_round(self) -> None:
        """Forget what belongs to one client's round (the live module is shared by clients)."""
        self.received: list[Tensor] = []  # x, the model this round started from
        self.server_control: list[Tensor] = []  # c
        self.correction: list[Tensor] = []  # c - c_i, fixed during the local update
        self.lr_sum = 0.0  # sum of the step sizes taken: K * eta_l for a constant rate
        self.delta_control: dict[str, Tensor] = {}

    def load_client_state(self, state: Mapping[str, Tensor]) -> None:
        super().load_client_state(state)
        self._reset_round()

    def on_receive(self, download: Payload | None) -> None:
        self._reset_round()
        super().on_receive(download)
        if isinstance(download, ScaffoldPayload):
            self.received = [p.detach().clone() for p in self.model.parameters()]
            self.server_control = [download.control[name].detach().clone() for name in self.control_variate.names]

    def on_fit_start(self) -> None:
        self.received = [x.to(self.device) for x in self.received]
        self.server_control = [c.to(self.device) for c in self.server_control]
        if self.server_control:
            self.correction = [
                c - c_i for c, c_i in zip(self.server_control, self.control_variate.tensors(), strict=True)
            ]

    @torch.no_grad()
    def correct_gradients(self) -> None:
        """``g <- g + c - c_i`` on every trainable parameter (Alg. 1's corrected local step)."""
        for param, correction in zip(self.model.parameters(), self.correction, strict=True):
            if not param.requires_grad:
                continue
            if param.grad is None:
                param.grad = correction.clone()  # unused in this step's loss: the correction alone
            else:
                param.grad.add_(correction)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.correction:
            return
        self.correct_gradients()
        self.lr_sum += float(optimizer.param_groups[0]["lr"])

    @torch.no_grad()
    def update_control_variate(self) -> None:
        """``c_i^+ = c_i - c + (x - y_i) / (K eta_l)``; keeps ``Delta c_i = c_i^+ - c_i`` for the upload."""
        if not self.received:
            return  # purely local training (no download): nothing to update
        names = self.control_variate.names
        if self.lr_sum <= 0:
            self.delta_control = {name: torch.zeros_like(c) for name, c in zip(names, self.server_control, strict=True)}
            return
        for name, c_i, c, x, y in zip(
            names,
            self.control_variate.tensors(),
            self.server_control,
            self.received,
            self.model.parameters(),
            strict=True,
        ):
            updated = c_i - c + (x - y) / self.lr_sum
            self.delta_control[name] = updated - c_i
            c_i.copy_(updated)

    def on_train_end(self) -> None:
        self.update_control_variate()

    def make_upload(self, train_batches: Iterable[Batch]) -> ScaffoldPayload:
        delta = self.delta_control or {name: torch.zeros_like(c) for name, c in self.control_variate.as_dict().items()}
        return ScaffoldPayload(weights=clone_state(self.model.state_dict()), control=clone_state(delta))


class ScaffoldServer(CorrectedAverageServer):
    """SCAFFOLD's server: ``x <- x + eta_g mean Delta y_i``, ``c <- c + (1/N) sum Delta c_i``, per architecture.

    Its state is the server control variate ``c`` (:attr:`state_by_architecture`); it reads ``global_lr``.
    """

    Hparams: ClassVar[type[Hyperparameters]] = ScaffoldHparams
    state_prefix = CONTROL_VARIATE
    state_key = "control_by_architecture"
    method_name = "SCAFFOLD"

    def check_upload(self, upload: ClientUpload) -> None:
        """The global model's layout (FedAvg's check) plus a control variate shaped like the server's ``c``."""
        payload = upload.expect(ScaffoldPayload, "SCAFFOLD's weights and control variate (ScaffoldPayload)")
        self.check_weights(upload, payload)
        reference = self.state_by_architecture[self.group(upload.architecture)]
        check_like(upload.sender, "control", payload.control, reference, "the server's c", "a control variate")

    def correct(
        self,
        state: dict[str, Tensor],
        model: dict[str, Tensor],
        previous: Mapping[str, Tensor],
        members: Sequence[ClientUpload],
        clients: int,
    ) -> None:
        for name, c in state.items():
            ys = torch.stack([u.payload.weights[name].double() for u in members])  # type: ignore[attr-defined]
            delta_y = ys.mean(0) - previous[name].double()  # (1/|S|) sum (y_i - x)
            model[name] = (previous[name].double() + self.hp.global_lr * delta_y).to(previous[name].dtype)
            delta_c = torch.stack([u.payload.control[name].double() for u in members]).sum(0)  # type: ignore[attr-defined]
            state[name] = (c.double() + delta_c / clients).to(c.dtype)  # (|S|/N) * mean = sum / N

    def download_for(self, client_id: int) -> ScaffoldPayload:
        key = self.group(self.architectures[client_id])
        return ScaffoldPayload(weights=self.global_by_architecture[key], control=self.state_by_architecture[key])


class SCAFFOLD(WeightAveraging):
    """SCAFFOLD, option II (homogeneous models only; plain SGD: ``optimizer=sgd``, ``momentum=0``)."""

    Hparams = ScaffoldHparams
    client_type = ScaffoldClient
    upload_type = ScaffoldPayload
    download_type = ScaffoldPayload

    def build_server(self) -> ServerPhase:
        return ScaffoldServer(self.hp)


__all__ = ["SCAFFOLD", "ScaffoldClient", "ScaffoldHparams", "ScaffoldPayload", "ScaffoldServer"]
