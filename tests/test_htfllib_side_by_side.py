"""The HtFLlib side of ``benchmarks/htfe2_round.py``: HtFLlib gets fedhet's very client splits in its own layout.

HtFLlib itself is not installed here (nor in CI); what can go wrong on fedhet's side is checked without it:
the files HtFLlib's ``utils/data_utils.read_data`` loads, the stand-ins for HtFLlib servers whose
dependencies are missing, and the one-line refusal of a folder that is no HtFLlib checkout.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def htfe2_round(monkeypatch):
    """The benchmark script as a module (it imports its ``_measure`` sibling)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import htfe2_round

    return htfe2_round


def test_htfllib_reads_fedhets_client_splits_normalised_as_fedhets_loader_serves_them(htfe2_round, tmp_path):
    """Every client's train and test split, as HtFLlib's read_data loads it: fedhet's images, labels and scaling."""
    scenario = htfe2_round.htfllib_scenario(4, 0)
    steps = htfe2_round.write_htfllib_dataset(scenario, tmp_path)
    for client_id in range(4):
        data = scenario.client_data(client_id)
        for split, part in (("train", data.train), ("test", data.test)):
            with open(tmp_path / split / f"{client_id}.npz", "rb") as file:  # how HtFLlib's read_data loads it
                loaded = np.load(file, allow_pickle=True)["data"].tolist()
            assert loaded["x"].dtype == np.float32
            assert loaded["x"].shape == tuple(part.x.shape) == (len(part), 3, 32, 32)
            assert np.array_equal(loaded["y"], part.y.numpy())
            served, _ = next(iter(scenario.eval_loader(part)))  # what fedhet's clients see of the same images
            assert torch.allclose(torch.from_numpy(loaded["x"][: len(served)]), served, atol=1e-6)
    # HtFLlib's train loader drops every last partial batch (batch 10)
    assert steps == sum(len(scenario.client_data(c).train) // 10 for c in range(4))


def test_htfllib_servers_whose_imports_are_missing_become_stand_ins(htfe2_round, tmp_path, monkeypatch):
    """main.py imports every server; one needing a package not installed becomes a stand-in, the rest import."""
    servers = tmp_path / "system" / "flcore" / "servers"
    servers.mkdir(parents=True)
    (servers / "serverproto.py").write_text("class FedProto:\n    pass\n")
    (servers / "serverktl.py").write_text("import a_package_nobody_installed\n\nclass FedKTL:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path / "system"))
    for name in ("flcore", "flcore.servers", "flcore.servers.serverproto", "flcore.servers.serverktl"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert htfe2_round.stub_unimportable_servers(tmp_path / "system") == ["serverktl"]
    from flcore.servers.serverktl import FedKTL  # what main.py does at its top: a stand-in, not an ImportError
    from flcore.servers.serverproto import FedProto

    assert FedKTL is None and isinstance(FedProto, type)
    for name in [n for n in sys.modules if n == "flcore" or n.startswith("flcore.")]:
        monkeypatch.delitem(sys.modules, name)


def test_a_folder_that_is_no_htfllib_checkout_is_one_line(htfe2_round, tmp_path):
    """--htfllib must name a checkout (its root or system/ folder); anything else stops before any run."""
    with pytest.raises(SystemExit, match="no HtFLlib checkout there"):
        htfe2_round.htfllib_main(str(tmp_path))
    (tmp_path / "system" / "flcore").mkdir(parents=True)
    (tmp_path / "system" / "main.py").write_text("")
    assert htfe2_round.htfllib_main(str(tmp_path)) == (tmp_path / "system" / "main.py").resolve()
