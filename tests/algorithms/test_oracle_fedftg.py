"""FedFTG one-step oracle: a client step of each base and a server round, against plain PyTorch.

Three clients with BatchNorm networks each run one local step of the base method (FedAvg,
FedProx, FedDyn, SCAFFOLD or MOON) from the downloaded model; the server aggregates as the
base does and runs FedFTG's data-free fine-tuning (Zhang et al., CVPR 2022, Algorithm 2,
Eqs. 4-10) for two iterations; client 0 then runs the next round's step from the fine-tuned
download (SCAFFOLD's correction, FedDyn's linear term and MOON's negative are non-zero only
then). Every parameter and buffer of the clients, the uploads, the download (SCAFFOLD's ``c``
included) and the persistent generator is compared with the oracle below to 1e-6.

Where fedhet follows the authors' code (ZhangLin-PKU/FedFTG) over the paper, so does the oracle
(``fedhet/algorithms/fedftg.py`` and ``docs/fedftg.md`` record each choice):

* default ``student_loss="soft_ce"``: the global model's loss is ``mean_{j,c} -p_ens log q``
  (the code's ``torch.mean``), ``generator_discrepancy="l1_logits"``: the generator maximises
  ``sum_k alpha^{k,y_j} mean_c |D(x_j; w) - D(x_j; w_k)|``; ``"kl_global_first"`` is Eq. (4);
* ``generator_step_per_teacher=True``: one Adam step per teacher with ``L_dis / |S_t|``;
* ``alpha^{k,y} = n_k^y / (sum_i n_i^y + 1e-6)`` (the code's eps); ``L_cls`` per sample (Eq. 6);
* the global model's BatchNorm in train mode during its steps (``server_bn_mode="train"``);
* both server rates decay as ``lr * lr_decay^t`` and both optimizers are new every round; the
  global model's SGD has weight decay; the generator persists across rounds.

The server's labels and noises come from the round's server seed: ``z ~ N(0, I)`` then
``y ~ p_t`` i.i.d. with one ``torch.Generator`` (fedhet's documented choice, A3).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from fedhet.algorithms import MOON, SCAFFOLD, FedAvg, FedDyn, FedFTG, FedProx
from fedhet.algorithms.base import ClientUpload, DataFormat, ServerContext
from fedhet.algorithms.fedftg import ConditionalImageGenerator
from tests.algorithms.oracle import (
    AdamOracle,
    TinyBNNet,
    assert_moved,
    assert_states_close,
    batch,
    client_step,
    clone,
    example_weighted_mean,
    prefixed,
    scaled_before_batch_norm,
    server_step,
    sgd_step,
    without_prefix,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # oracles compare to 1e-6: one summation order

#: The registered methods whose one-step oracle lives here (``test_oracle_registry.py`` reads it).
ORACLE_COVERS = {"fedftg"}

M, CHANNELS, SIZE = 4, 1, 8
#: Label counts of the three clients; class 3 is held by clients 0 and 1 only, so its
#: alpha column is (2/3, 1/3, 0); no class is missing (p_t never 0 for a class all hold).
COUNTS = torch.tensor([[5, 0, 1, 2], [0, 3, 1, 1], [1, 2, 4, 0]])
EXAMPLES = (8, 6, 10)  # num_examples of the uploads: FedAvg's weights
FORMAT = DataFormat(image_size=SIZE, channels=CHANNELS, mean=(0.0,), std=(1.0,), num_classes=M)
ROUND = 2  # t: the server rates are lr * decay^2
SERVER_SEED = 77
LOCAL_LR = 0.1
TINY = dict(
    iterations=2,
    generator_steps=1,
    student_steps=2,
    batch_size=6,
    noise_dim=4,
    generator_width=2,
    generator_lr=0.01,
    student_lr=0.1,
    student_weight_decay=1e-3,
    lr_decay=0.5,  # far from 1, so a dropped decay moves the result well past the tolerance
)

BASES = {
    "fedavg": lambda: FedAvg(lr=LOCAL_LR),
    "fedprox": lambda: FedProx(mu=0.5, lr=LOCAL_LR),
    "feddyn": lambda: FedDyn(alpha=0.3, lr=LOCAL_LR),
    "scaffold": lambda: SCAFFOLD(lr=LOCAL_LR),
    "moon": lambda: MOON(mu=2.0, temperature=0.5, projection_dim=3, lr=LOCAL_LR),
}


def network(algorithm, seed: int):
    """The client network exactly as the method builds it (MOON adds its projection head)."""
    return algorithm.build_client(TinyBNNet(CHANNELS, M, seed=seed), M).model


def make_context(algorithm) -> ServerContext:
    """Three clients of one architecture, their label counts, the image format, the model factory."""
    initial = algorithm.build_client(TinyBNNet(CHANNELS, M, seed=100), M).client_state()
    return ServerContext(
        num_clients=3,
        num_classes=M,
        architectures=("tiny",) * 3,
        seed=5,
        initial_client_state=lambda cid: clone(initial),
        data_format=FORMAT,
        label_counts=COUNTS,
        model_factory=lambda architecture, seed: network(algorithm, seed),
    )


# ---------------------------------------------------------------------- the oracle: clients
def net_from(template: torch.nn.Module, state: dict[str, Tensor]) -> torch.nn.Module:
    """A copy of ``template`` holding ``state``."""
    net = copy.deepcopy(template)
    net.load_state_dict(state)
    return net


def oracle_client(
    base: str, template, state: dict[str, Tensor], download, data, hp, steps: int = 1
) -> tuple[dict, dict]:
    """``steps`` local SGD steps of ``base`` (train mode) from the download; returns (client state, upload parts).

    ``state`` is the client's kept state (``model.*`` and the base's extras), ``download`` the
    global weights (and SCAFFOLD's ``c``).
    """
    x, y = data
    global_weights = dict(download["weights"])
    net = net_from(template, global_weights)  # every base starts the round from the download
    net.train()
    params = dict(net.named_parameters())
    anchor = {k: global_weights[k].clone() for k in params}
    extras: dict[str, Tensor] = {}
    for _ in range(steps):
        features = net.forward_features(x)
        loss = F.cross_entropy(net.forward_head(features), y)
        if base == "fedprox":  # Li et al. Eq. 2: + mu/2 ||w - w_t||^2
            loss = loss + hp["mu"] / 2 * sum(((p - anchor[k]) ** 2).sum() for k, p in params.items())
        if (
            base == "feddyn"
        ):  # Acar et al. Alg. 1: - <grad L_k(theta_k^{t-1}), theta> + alpha/2 ||theta - theta^{t-1}||^2
            g = {k: state[f"gradient_state.{k}"] for k in params}
            loss = loss - sum((p * g[k]).sum() for k, p in params.items())
            loss = loss + hp["alpha"] / 2 * sum(((p - anchor[k]) ** 2).sum() for k, p in params.items())
        if base == "moon" and state["has_previous_model"]:  # Li et al. (MOON) Eq. 3, previous = the kept model
            with torch.no_grad():
                z_glob = net_from(template, global_weights).eval().forward_features(x)
                z_prev = net_from(template, without_prefix(state, "model.")).eval().forward_features(x)
            pos = torch.exp(F.cosine_similarity(features, z_glob, dim=-1) / hp["temperature"])
            neg = torch.exp(F.cosine_similarity(features, z_prev, dim=-1) / hp["temperature"])
            loss = loss + hp["mu"] * (-torch.log(pos / (pos + neg))).mean()
        loss.backward()
        if base == "scaffold":  # Karimireddy et al. Alg. 1: y <- y - eta (g - c_i + c)
            for k, p in params.items():
                p.grad = p.grad + download["control"][k] - state[f"control_variate.{k}"]
        sgd_step(params.values(), LOCAL_LR)
    new_state = prefixed(clone(net.state_dict()), "model.")
    if base == "feddyn":  # state update: g <- g - alpha (theta_k^t - theta^{t-1})
        for k, p in params.items():
            new_state[f"gradient_state.{k}"] = state[f"gradient_state.{k}"] - hp["alpha"] * (p.detach() - anchor[k])
    if base == "scaffold":  # option II: c_i+ = c_i - c + (x - y) / (K eta)
        for k, p in params.items():
            c_i = state[f"control_variate.{k}"]
            updated = c_i - download["control"][k] + (anchor[k] - p.detach()) / (steps * LOCAL_LR)
            new_state[f"control_variate.{k}"] = updated
            extras[k] = updated - c_i
    if base == "moon":
        new_state["has_previous_model"] = torch.tensor(True)
    return new_state, extras


def oracle_aggregate(
    base: str, previous: dict[str, Tensor], uploads: list[dict], control: dict, hp
) -> tuple[dict, dict]:
    """The base's closed-form server step: (global weights, SCAFFOLD's c)."""
    states = [u["weights"] for u in uploads]
    if base in ("fedavg", "fedprox", "moon"):  # McMahan et al.: example-weighted mean, BN buffers included
        return example_weighted_mean(states, [u["n"] for u in uploads]), control
    mean = example_weighted_mean(states, [1.0] * len(states))  # uniform over participants (buffers too)
    if base == "feddyn":  # h = -alpha/m sum (theta_k - theta^{t-1}); theta = mean - h / alpha  (parameters only)
        for k in hp["param_names"]:
            h = -hp["alpha"] / 3 * sum(s[k].double() - previous[k].double() for s in states)
            mean[k] = (mean[k].double() - h / hp["alpha"]).float()
        return mean, control
    # SCAFFOLD (eta_g = 1): x = mean y for parameters; c <- c + (1/N) sum Delta c_i
    new_control = {k: control[k] + sum(u["control"][k] for u in uploads) / 3 for k in control}
    return mean, new_control


# ---------------------------------------------------------------------- the oracle: the server refinement
def diversity(noise: Tensor, images: Tensor) -> Tensor:
    """FedGen's / FedFTG's Eq. (7) as the code computes it: ``exp(-mean_ij d_z(i,j) d_x(i,j))``."""
    flat = images.flatten(1)
    d_x = (flat[:, None] - flat[None]).abs().mean(2)
    d_z = ((noise[:, None] - noise[None]) ** 2).mean(2)
    return torch.exp(-(d_z * d_x).mean())


def kl_global_first(student: Tensor, teachers: Tensor, weights: Tensor) -> Tensor:
    """Eq. (4): ``mean_j sum_k A[j,k] sum_c q_c (log q_c - log p_kc)``, ``q`` the global model's softmax."""
    q = student.softmax(1)
    total = 0.0
    for k in range(teachers.shape[0]):
        per = (q * (student.log_softmax(1) - teachers[k].detach().log_softmax(1))).sum(1)
        total = total + weights[:, k] * per
    return total.mean()


def oracle_refine(global_state, teacher_states, gen_state, template, hp) -> tuple[dict, dict]:
    """Algorithm 2 after the aggregation, ``I`` iterations: returns (fine-tuned global state, generator state)."""
    K = len(teacher_states)
    teachers = [net_from(template, s).eval().requires_grad_(False) for s in teacher_states]
    student = net_from(template, global_state)
    generator = ConditionalImageGenerator(TINY["noise_dim"], M, SIZE, CHANNELS, TINY["generator_width"])
    generator.load_state_dict(gen_state)
    counts = COUNTS.double()
    totals = counts.sum(0)
    p_t = totals / totals.sum() if hp["label_sampling"] else torch.full((M,), 1.0 / M, dtype=torch.float64)
    alpha = counts / (totals + 1e-6) if hp["class_ensemble"] else torch.full((K, M), 1.0 / K, dtype=torch.float64)
    alpha = alpha.float()
    rng = torch.Generator().manual_seed(SERVER_SEED)
    Q, total = TINY["batch_size"], TINY["iterations"] * TINY["batch_size"]
    noise = torch.randn(total, TINY["noise_dim"], generator=rng)
    labels = torch.multinomial(p_t.float(), total, replacement=True, generator=rng)
    decay = TINY["lr_decay"] ** ROUND
    adam = AdamOracle(generator.parameters(), TINY["generator_lr"] * decay)
    per_teacher = hp["generator_step_per_teacher"]
    for i in range(TINY["iterations"]):
        z, y = noise[i * Q : (i + 1) * Q], labels[i * Q : (i + 1) * Q]
        A = alpha[:, y].t()  # [Q, K]: alpha^{k, y_j} of each sample's own label
        # hard-sample mining: generator trains, the global model is frozen in eval mode
        student.eval().requires_grad_(False)
        generator.train()
        groups = [[k] for k in range(K)] if per_teacher else [list(range(K))]
        for _ in range(TINY["generator_steps"]):
            for group in groups:
                x = generator(z, y)
                t = torch.stack([teachers[k](x) for k in group])
                w = A[:, group]
                fidelity = sum(w[:, g] * F.cross_entropy(t[g], y, reduction="none") for g in range(len(group))).mean()
                loss = hp["lambda_cls"] * fidelity + hp["lambda_dis"] * len(group) / K * diversity(z, x)
                if hp["hard_sample_mining"]:
                    s = student(x)
                    if hp["generator_discrepancy"] == "l1_logits":
                        md = sum(w[:, g] * (s - t[g].detach()).abs().mean(1) for g in range(len(group))).mean()
                    else:
                        md = kl_global_first(s, t, w)
                    loss = loss - md
                adam.zero_grad()
                loss.backward()
                adam.step()
        student.requires_grad_(True)
        # knowledge transfer: global model in train mode (BN frozen on request), generator in eval mode
        generator.eval()
        student.train()
        if hp["server_bn_mode"] == "frozen":
            student.bn.eval() if hasattr(student, "bn") else student.backbone.bn.eval()
        with torch.no_grad():
            x = generator(z, y)
            t = torch.stack([teacher(x) for teacher in teachers])
            p_ens = sum(A[:, k : k + 1] * t[k].softmax(1) for k in range(K))
        for _ in range(TINY["student_steps"]):
            logits = student(x)
            if hp["student_loss"] == "soft_ce":
                loss = (-p_ens * logits.log_softmax(1)).mean()
            else:
                loss = kl_global_first(logits, t, A)
            loss.backward()
            sgd_step(student.parameters(), TINY["student_lr"] * decay, TINY["student_weight_decay"])
    return clone(student.state_dict()), clone(generator.state_dict())


# ---------------------------------------------------------------------- the test
def conditioned(generator_state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The generator's state with its two hidden convolutions (each before a BatchNorm) rescaled.

    A numerical precaution, the function is the same: see :func:`scaled_before_batch_norm`.
    """
    return scaled_before_batch_norm(generator_state, [("body.2", "body.3"), ("body.6", "body.7")])


DEFAULTS = dict(
    hard_sample_mining=True,
    label_sampling=True,
    class_ensemble=True,
    generator_step_per_teacher=True,
    student_loss="soft_ce",
    generator_discrepancy="l1_logits",
    server_bn_mode="train",
    lambda_cls=1.0,
    lambda_dis=1.0,
)

SWITCHES = {
    "defaults": {},
    "bn_frozen": {"server_bn_mode": "frozen"},
    "kl_global_first": {"student_loss": "kl_global_first", "generator_discrepancy": "kl_global_first"},
    "one_generator_step": {"generator_step_per_teacher": False},
    "ablations": {"hard_sample_mining": False, "label_sampling": False, "class_ensemble": False},
    "lambdas": {"lambda_cls": 0.5, "lambda_dis": 2.0},
}


def run_case(base_name: str, switches: dict) -> None:
    """Round ``t``'s client steps, the server round, client 0's next step: each against the oracle."""
    hp_base = {"mu": 0.5, "alpha": 0.3, "temperature": 0.5}
    if base_name == "moon":
        hp_base["mu"] = 2.0
    algorithm = FedFTG(base=BASES[base_name](), **TINY, **switches)
    algorithm.configure(FORMAT)  # as the runtime does before building anything
    context = make_context(algorithm)
    server = algorithm.build_server()
    server.setup_server(context)
    template = network(algorithm, 0)
    hp_base["param_names"] = [k for k, _ in template.named_parameters()]
    generator_before = conditioned(server.server_state()["refinement"]["generator"])
    server.load_server_state({**server.server_state(), "refinement": {"generator": clone(generator_before)}})
    initial_download = server.download_for(0)
    control0 = {k: torch.zeros_like(v) for k, v in getattr(initial_download, "control", {}).items()}

    # ---- round ROUND: every client's local step
    modules, uploads, expected_uploads, states = [], [], [], []
    for cid in range(3):
        module = algorithm.build_client(TinyBNNet(CHANNELS, M, seed=10 + cid), M)
        state = clone(module.client_state())
        download = server.download_for(cid)
        payload = client_step(module, download, batch(cid), round_idx=ROUND, num_examples=EXAMPLES[cid])
        expected_state, delta_c = oracle_client(
            base_name, template, state, {"weights": download.weights, "control": control0}, batch(cid), hp_base
        )
        assert_states_close(module.client_state(), expected_state, f"client {cid} state after its step")
        assert_states_close(payload.weights, without_prefix(expected_state, "model."), f"client {cid} upload")
        if base_name == "scaffold":
            assert_states_close(payload.control, delta_c, f"client {cid} Delta c_i")
        modules.append(module)
        states.append(expected_state)
        uploads.append(ClientUpload(cid, "tiny", payload))
        expected_uploads.append(
            {"weights": without_prefix(expected_state, "model."), "n": EXAMPLES[cid], "control": delta_c}
        )

    # ---- the server round: base aggregation, then FedFTG's refinement
    previous = dict(initial_download.weights)
    server_step(server, ROUND, uploads, seed=SERVER_SEED)
    average, control = oracle_aggregate(base_name, previous, expected_uploads, control0, hp_base)
    hp = {**DEFAULTS, **switches}
    tuned, generator_after = oracle_refine(
        average, [u["weights"] for u in expected_uploads], generator_before, template, hp
    )
    download = server.download_for(0)
    assert_moved(average, download.weights, "fine-tuning")
    assert_states_close(download.weights, tuned, "fine-tuned global model")
    # the rescaled layers' BatchNorm statistics are ~1e6: compared relative to their size (float32 ulp)
    assert_states_close(server.server_state()["refinement"]["generator"], generator_after, "generator", rtol=1e-6)
    if base_name == "scaffold":
        assert_states_close(download.control, control, "server control variate c")

    # ---- round ROUND + 1: client 0 again, from the fine-tuned download and its kept state
    client_step(modules[0], download, batch(5), round_idx=ROUND + 1, state=modules[0].client_state())
    expected_state, _ = oracle_client(
        base_name, template, states[0], {"weights": tuned, "control": control}, batch(5), hp_base
    )
    assert_states_close(modules[0].client_state(), expected_state, "client 0 state in the next round")


@pytest.mark.parametrize("switch", sorted(SWITCHES))
def test_fedftg_on_fedavg_matches_the_oracle(switch):
    """Every documented switch at a non-default value, on FedAvg (the CPU configs' base)."""
    run_case("fedavg", SWITCHES[switch])


@pytest.mark.parametrize("base", ["fedprox", "feddyn", "scaffold", "moon"])
def test_fedftg_on_every_base_matches_the_oracle(base):
    """Each of Table 3's bases: its client objective, its aggregation, then the same fine-tuning."""
    run_case(base, {})
