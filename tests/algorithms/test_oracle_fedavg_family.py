"""One-step oracles of FedAvg, FedProx, FedDyn, SCAFFOLD and MOON on their own (no server refinement).

The client objectives and closed-form aggregations are the plain-PyTorch ones of
``test_oracle_fedftg.py`` (McMahan et al.; Li et al., Eq. 2; Acar et al., Algorithm 1;
Karimireddy et al., Algorithm 1 option II; Li, He and Song, Eq. 3): two of three clients take
two local steps each from the initial download (the proximal and dynamic terms act from the
second step; partial participation separates ``1/N`` from ``1/|S|``), the server aggregates, and
client 0 steps again from the new download with its kept state (SCAFFOLD's correction, FedDyn's
linear term and MOON's negative are live only then). Every parameter and buffer, the uploads and
the download are compared to 1e-6.
"""

from __future__ import annotations

import pytest
import torch

from fedhet.algorithms.base import ClientUpload
from tests.algorithms.oracle import (
    TinyBNNet,
    assert_moved,
    assert_states_close,
    batch,
    client_step,
    clone,
    server_step,
    without_prefix,
)
from tests.algorithms.test_oracle_fedftg import (
    BASES,
    CHANNELS,
    EXAMPLES,
    FORMAT,
    M,
    make_context,
    network,
    oracle_aggregate,
    oracle_client,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # oracles compare to 1e-6: one summation order

#: The registered methods whose one-step oracle lives here (``test_oracle_registry.py`` reads it).
ORACLE_COVERS = {"fedavg", "fedprox", "feddyn", "scaffold", "moon"}

STEPS = 2  # local steps per round (one pass over the fixed batch each)


@pytest.mark.parametrize("base_name", sorted(BASES))
def test_weight_averaging_method_matches_the_oracle(base_name):
    """Client steps, the aggregation and the next round's step of ``base_name``, each against the oracle."""
    hp = {"mu": 2.0 if base_name == "moon" else 0.5, "alpha": 0.3, "temperature": 0.5}
    algorithm = BASES[base_name]()
    algorithm.configure(FORMAT)
    server = algorithm.build_server()
    server.setup_server(make_context(algorithm))
    template = network(algorithm, 0)
    hp["param_names"] = [k for k, _ in template.named_parameters()]
    initial = server.download_for(0)
    control0 = {k: torch.zeros_like(v) for k, v in getattr(initial, "control", {}).items()}
    modules, states, uploads, expected = [], [], [], []
    for cid in range(2):  # client 2 sits the round out
        module = algorithm.build_client(TinyBNNet(CHANNELS, M, seed=10 + cid), M)
        state = clone(module.client_state())
        download = server.download_for(cid)
        payload = client_step(module, download, batch(cid), round_idx=0, num_examples=EXAMPLES[cid], epochs=STEPS)
        new_state, delta_c = oracle_client(
            base_name, template, state, {"weights": download.weights, "control": control0}, batch(cid), hp, STEPS
        )
        assert_moved(state, module.client_state(), f"client {cid}")
        assert_states_close(module.client_state(), new_state, f"client {cid} state")
        assert_states_close(payload.weights, without_prefix(new_state, "model."), f"client {cid} upload")
        if base_name == "scaffold":
            assert_states_close(payload.control, delta_c, f"client {cid} Delta c_i")
        modules.append(module)
        states.append(new_state)
        uploads.append(ClientUpload(cid, "tiny", payload))
        expected.append({"weights": without_prefix(new_state, "model."), "n": EXAMPLES[cid], "control": delta_c})

    server_step(server, 0, uploads)
    weights, control = oracle_aggregate(base_name, dict(initial.weights), expected, control0, hp)
    download = server.download_for(0)
    assert_states_close(download.weights, weights, "global model")
    if base_name == "scaffold":
        assert_states_close(download.control, control, "server control variate c")

    client_step(modules[0], download, batch(5), round_idx=1, state=modules[0].client_state(), epochs=STEPS)
    new_state, _ = oracle_client(
        base_name, template, states[0], {"weights": weights, "control": control}, batch(5), hp, STEPS
    )
    assert_states_close(modules[0].client_state(), new_state, "client 0 in the next round")
