"""FedKD one-step oracle: adaptive mutual distillation, SVD-compressed updates, the server round.

Written from the paper (Wu et al., "Communication-efficient federated learning via knowledge
distillation", Nature Communications 2022, Eq. 1-6) with fedhet's documented choices
(``fedhet/algorithms/fedkd.py``), which the oracle follows too:

* teacher ``L_t = CE_t + w KL(p_s || p_t) + w MSE(H_t, W_h H_s)``, student
  ``L_s = CE_s + w KL(p_t || p_s) + w MSE(H_t, W_h H_s)`` with ``w = 1 / (CE_t + CE_s)``
  (Eq. 1-4), ``w`` a constant for back-propagation and each loss's peer output a constant (the
  teacher's MSE pulls ``H_t`` only, the student's pulls ``W_h H_s`` only); KL per sample, batch mean;
* one SGD optimizer: the teacher at ``lr``, the student and ``W_h`` at ``student_lr``; each of
  teacher, student and ``W_h`` clipped to ``max_grad_norm`` on its own (HtFLlib);
* the upload is the student's round update with every matrix (conv kernels as
  ``out x in*kh*kw``) replaced by its truncated SVD: the smallest rank ``k`` whose top singular
  values keep at least the round's energy ``T_start + (t + 1) / R (T_end - T_start)`` of
  ``sum sigma^2`` (Eq. 5-6), only where the factors are fewer numbers than the matrix;
* the server adds the uniform mean of the decompressed updates to the global student and sends
  it back compressed the same way at the round's energy.

Two clients (TinyBNNet teachers, a ``cnn_tiny`` student with BatchNorm) run round 0 for two
steps, the server aggregates, and client 0 runs round 1 from the download with its kept teacher
and ``W_h``, with fedhet's defaults, with clipping, and with HtFLlib's choices (compressed weights
rather than updates, sample-weighted average, KL averaged over classes too). Every parameter and
buffer, both uploads (decompressed), the server's student and the download are compared with the
oracle to 1e-6. The energy is low enough that truncation changes the numbers
(checked), so a missing or wrong compression fails too.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from fedhet.algorithms import get_algorithm
from fedhet.algorithms.base import ClientUpload, ServerContext
from fedhet.seeding import seeded
from tests.algorithms.oracle import (
    TinyBNNet,
    assert_moved,
    assert_states_close,
    batch,
    client_step,
    clone,
    example_weighted_mean,
    prefixed,
    server_step,
    sgd_step,
    without_prefix,
)
from tests.algorithms.test_oracle_fedftg import CHANNELS, FORMAT, M
from tests.algorithms.test_oracle_partial import clip_each

pytestmark = pytest.mark.usefixtures("one_thread")  # oracles compare to 1e-6: one summation order

#: The registered methods whose one-step oracle lives here (``test_oracle_registry.py`` reads it).
ORACLE_COVERS = {"fedkd"}

LR, STUDENT_LR, WEIGHT_DECAY, STEPS, TOTAL_ROUNDS = 0.1, 0.3, 1e-3, 2, 4
T_START, T_END = 0.6, 0.8
EXAMPLES = (8, 6)


def energy(round_idx: int) -> float:
    """The official code's schedule: ``T_start + (t + 1) / R (T_end - T_start)``."""
    return T_START + (round_idx + 1) / TOTAL_ROUNDS * (T_END - T_START)


def truncated(state: dict[str, Tensor], keep: float) -> dict[str, Tensor]:
    """What the receiver rebuilds: each floating matrix (``[rows, -1]``) as its rank-``k`` SVD, if that is smaller."""
    out = {}
    for name, tensor in state.items():
        out[name] = tensor.clone()
        if not tensor.is_floating_point() or tensor.dim() < 2 or tensor.shape[0] < 2:
            continue
        matrix = tensor.reshape(tensor.shape[0], -1)
        u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
        squares = s.double() ** 2
        k = next(i + 1 for i in range(len(s)) if squares[: i + 1].sum() >= keep * squares.sum())
        rows, cols = matrix.shape
        if k * (rows + cols + 1) < rows * cols:
            out[name] = (u[:, :k] @ torch.diag(s[:k]) @ vh[:k]).reshape(tensor.shape)
    return out


def kl(target_logits: Tensor, logits: Tensor, reduction: str) -> Tensor:
    """``KL(softmax(target) || softmax(logits))`` per sample, batch mean (``"mean"``: also over classes)."""
    p = torch.softmax(target_logits.detach(), 1)
    per_sample = (p * (torch.log_softmax(target_logits.detach(), 1) - torch.log_softmax(logits, 1))).sum(1)
    return per_sample.mean() / (M if reduction == "mean" else 1)


class OracleClient:
    """A FedKD client in plain PyTorch: teacher, student, ``W_h``."""

    def __init__(self, state: dict[str, Tensor], student_template: torch.nn.Module, max_grad_norm, hp) -> None:
        self.hp = hp
        self.teacher = TinyBNNet(CHANNELS, M)
        self.teacher.load_state_dict(without_prefix(state, "model."))
        self.student = copy.deepcopy(student_template)
        self.student.load_state_dict(without_prefix(state, "student."))
        w_h = without_prefix(state, "hidden_map.")["weight"]
        self.hidden_map = torch.nn.Linear(w_h.shape[1], w_h.shape[0], bias=False)
        self.hidden_map.load_state_dict({"weight": w_h})
        self.max_grad_norm = max_grad_norm
        self.extra = {k: v for k, v in state.items() if not k.startswith(("model.", "student.", "hidden_map."))}

    def state(self) -> dict[str, Tensor]:
        return {
            **self.extra,
            **prefixed(clone(self.teacher.state_dict()), "model."),
            **prefixed(clone(self.student.state_dict()), "student."),
            **prefixed(clone(self.hidden_map.state_dict()), "hidden_map."),
        }

    def round(self, data, download: dict[str, Tensor] | None) -> None:
        """Receive the (decompressed) student, then ``STEPS`` SGD steps of ``L_t + L_s``."""
        if download is not None:
            self.student.load_state_dict(download)
        x, y = data
        for _ in range(STEPS):
            self.teacher.train()
            self.student.train()
            h_t = self.teacher.forward_features(x)
            h_s = self.student.forward_features(x)
            z_t, z_s = self.teacher.forward_head(h_t), self.student.forward_head(h_s)
            mapped = self.hidden_map(h_s)
            ce_t, ce_s = F.cross_entropy(z_t, y), F.cross_entropy(z_s, y)
            w = 1.0 / (ce_t.detach() + ce_s.detach())  # Eq. 1-4, a constant weight
            reduction = self.hp["kl_reduction"]
            loss_t = ce_t + w * kl(z_s, z_t, reduction) + w * F.mse_loss(h_t, mapped.detach())
            loss_s = ce_s + w * kl(z_t, z_s, reduction) + w * F.mse_loss(h_t.detach(), mapped)
            (loss_t + loss_s).backward()
            if self.max_grad_norm is not None:
                groups = [self.teacher.parameters(), self.student.parameters(), self.hidden_map.parameters()]
                clip_each([list(g) for g in groups], self.max_grad_norm)
            sgd_step(self.teacher.parameters(), LR, WEIGHT_DECAY)
            sgd_step([*self.student.parameters(), *self.hidden_map.parameters()], STUDENT_LR, WEIGHT_DECAY)


DEFAULTS = {"compressed_quantity": "update", "student_weighting": "uniform", "kl_reduction": "batchmean"}
HTFLLIB = {"compressed_quantity": "weights", "student_weighting": "samples", "kl_reduction": "mean"}


@pytest.mark.parametrize(("max_grad_norm", "switches"), [(None, {}), (0.5, {}), (None, HTFLLIB)])
def test_fedkd_matches_the_oracle(max_grad_norm, switches):
    """Two clients' round 0, the server's average and compressed download, client 0's round 1."""
    run_case(max_grad_norm, switches)


def run_case(max_grad_norm: float | None, switches: dict, seed: int = 0) -> None:
    """The three steps of the module docstring, each against the oracle (``switches``: HtFLlib's choices)."""
    hp = {**DEFAULTS, **switches}
    algorithm = get_algorithm("fedkd")(
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        student_lr=STUDENT_LR,
        student_model="cnn_tiny",
        t_start=T_START,
        t_end=T_END,
        max_grad_norm=max_grad_norm,
        **switches,
    )
    algorithm.configure(FORMAT)
    modules = []
    for cid in range(2):
        with seeded(seed + cid):  # W_h's initialisation draws from the global RNG
            modules.append(algorithm.build_client(TinyBNNet(CHANNELS, M, seed=10 + cid), M))
    states = [clone(m.client_state()) for m in modules]
    initial_student = without_prefix(states[0], "student.")
    assert_states_close(without_prefix(states[1], "student."), initial_student, "one student initialisation")
    server = algorithm.build_server()
    server.setup_server(
        ServerContext(
            num_clients=2,
            num_classes=M,
            architectures=("tiny",) * 2,
            seed=5,
            initial_client_state=lambda cid: clone(states[0]),
            data_format=FORMAT,
        )
    )
    assert server.download_for(0) is None  # round 0 starts from the common initialisation
    student_template = copy.deepcopy(modules[0].student)

    oracles, updates, uploads = [], [], []
    for cid, module in enumerate(modules):
        data = batch(cid)
        payload = client_step(module, None, data, 0, TOTAL_ROUNDS, num_examples=EXAMPLES[cid], epochs=STEPS)
        oracle = OracleClient(states[cid], student_template, max_grad_norm, hp)
        oracle.round(data, None)
        assert_moved(states[cid], module.client_state(), f"client {cid}")
        assert_states_close(module.client_state(), oracle.state(), f"client {cid} after round 0")
        assert payload.energy == pytest.approx(energy(0))
        # compressed from the client's own student (checked equal above to 1e-6): a float32 SVD
        # turns 1-ulp differences of its input into differences of about 1e-6 in its output
        raw = without_prefix(module.client_state(), "student.")
        if hp["compressed_quantity"] == "update":
            raw = {k: v - initial_student[k] if v.is_floating_point() else v for k, v in raw.items()}
        update = truncated(raw, energy(0))
        assert_states_close(payload.decompressed(initial_student), update, f"client {cid}'s decompressed upload")
        lost = max((raw[k] - update[k]).abs().max().item() for k in raw if raw[k].is_floating_point())
        assert lost > 1e-4, "the energy keeps every update whole: the test would not see the compression"
        oracles.append(oracle)
        updates.append(update)
        uploads.append(ClientUpload(cid, "tiny", payload))

    server_step(server, 0, uploads)
    weights = EXAMPLES if hp["student_weighting"] == "samples" else [1, 1]  # uniform, as both codes
    mean_update = example_weighted_mean(updates, weights)
    merged = {k: v + mean_update[k] if v.is_floating_point() else mean_update[k] for k, v in initial_student.items()}
    if hp["compressed_quantity"] == "weights":
        merged = mean_update
    held = server.server_state()["global_student"]
    assert_states_close(held, merged, "the global student before compression")
    # compressed from the server's own copy, for the same reason as the uploads
    sent = truncated(held, energy(0))
    assert max((held[k] - sent[k]).abs().max().item() for k in held if held[k].is_floating_point()) > 1e-4
    download = server.download_for(0)
    assert_states_close(download.decompressed(initial_student), sent, "the download (decompressed)")

    state = clone(modules[0].client_state())
    client_step(modules[0], download, batch(2), 1, TOTAL_ROUNDS, state=state, epochs=STEPS)
    oracles[0].round(batch(2), sent)
    assert_states_close(modules[0].client_state(), oracles[0].state(), "client 0 after round 1")
