"""Every scenario folder of ``configs/experiments/`` is one fair comparison (``fedhet.compare_configs``).

The configs of a folder may differ only in the method and its own hyperparameters: client
optimizer, learning-rate schedule, local budget, rounds, seed and data are shared. Intended
differences (an ablation row, a method's own requirement) are declared below with a reason per
key; anything else fails with one line naming the config, the key and both values.

``paper/`` is not checked: each of its folders reproduces one paper table with the settings the
authors report per method (``docs/*.md`` of each paper), on GPU-scale data, so its rows are the
paper's protocol rather than a platform-controlled comparison.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fedhet.compare_configs import Difference, folder_differences, report

ROOT = Path(__file__).resolve().parents[1] / "configs" / "experiments"
FOLDERS = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and p.name != "paper")

#: Declared differences: folder -> config -> {key: reason}.
FEDVTC_ROUNDS = "FedVTC's own fine-tuning phase is the 5 extra full-participation rounds the baselines get"
FEDVTC_LATENT = "FedVTC's own latent layer gives p = 980; the baselines reach p = 980 through the feature neck"
FEDVTC_CLIP = (
    "FedVTC optimises manually (its VTC and model steps), where Lightning's gradient_clip_val does not apply; "
    "it clips at the same norm 5 through its own max_grad_norm"
)
FEDGEN_CLIP = (
    "FedGen's generated-feature cross-entropy has a gradient proportional to the generator's unbounded output "
    "(client losses of 80-3,700 right after its first fit); at the folder's SGD 0.05 / momentum 0.9 it diverged "
    "(digits_dir, seed 2, round 15: docs/results/archive/stability_2026-11-26.md; mnist_mdcg, seed 0, round 11), "
    "so it clips at norm 5 as every mnist_vtc method does"
)
FEDTGP_CLIP = (
    "FedTGP's clients pull their features (lambda 10 x MSE) onto server prototypes that its margin loss pushes "
    "apart up to tau = 100, so the loss grows every round; at the folder's SGD 0.05 / momentum 0.9 it diverged "
    "(digits_dir, seeds 2, 3 and 4: docs/results/archive/stability_2026-11-26.md), so it clips at norm 5 as "
    "FedGen does"
)
FEDPROX_PAPER = (
    "FedProx's Synthetic(1,1) reproduction (30 devices, 200 rounds, 20 epochs); the other config is a "
    "10,000-client scale demo, not a row of the same comparison"
)
FEDGEN_CLIPPED = {"fedgen.yaml": {"trainer.gradient_clip_val": FEDGEN_CLIP}}
#: the label-skew Digits folders clip FedGen and FedTGP alike
DIGITS_CLIPPED = {**FEDGEN_CLIPPED, "fedtgp.yaml": {"trainer.gradient_clip_val": FEDTGP_CLIP}}
ALLOWED: dict[str, dict[str, dict[str, str]]] = {
    "digits_dir": {
        **DIGITS_CLIPPED,
        "scaffold.yaml": {
            "client_optimizer.momentum": (
                "SCAFFOLD option II's c_i = (x - y) / (K lr) assumes plain SGD steps; it refuses momentum"
            ),
        },
    },
    "digits_path": DIGITS_CLIPPED,
    "mnist_mdcg": FEDGEN_CLIPPED,
    "mnist_vtc": {
        name: {
            "federation.extra_rounds": FEDVTC_ROUNDS,
            "feature_dim[feature-exchanging methods]": FEDVTC_LATENT,
            "trainer.gradient_clip_val": FEDVTC_CLIP,
        }
        for name in ("fedvtc.yaml", "fedvtc_e.yaml")
    },
    "synthetic": {
        "fedprox.yaml": {
            key: FEDPROX_PAPER
            for key in (
                "federation.participation",
                "rounds",
                "scenario.init_args.num_clients",
                "trainer.max_epochs",
                "trainer.max_steps",
            )
        },
    },
}


def test_the_comparison_names_config_key_and_both_values():
    """A config departing from its folder is reported in one line with its key, its value and the folder's."""
    settings = {
        "a.yaml": {"client_optimizer.lr": 0.05, "rounds": 20},
        "b.yaml": {"client_optimizer.lr": 0.05, "rounds": 20},
        "c.yaml": {"client_optimizer.lr": 0.01, "rounds": 20},
    }
    differences, stale = folder_differences("x/folder", settings=settings)
    assert differences == [Difference("c.yaml", "client_optimizer.lr", 0.01, 0.05)]
    assert report("x/folder", differences) == "folder: c.yaml: client_optimizer.lr=0.01 (folder: 0.05)"
    # a declared difference is left out; a declared one that does not differ is reported as stale
    allowed = {"c.yaml": {"client_optimizer.lr": "ablation"}, "a.yaml": {"rounds": "longer"}}
    differences, stale = folder_differences("x/folder", allowed, settings=settings)
    assert differences == [] and stale == ["a.yaml: rounds is allowed to differ (longer) but does not"]


@pytest.mark.parametrize("folder", FOLDERS)
def test_scenario_folder_is_one_fair_comparison(folder):
    """Every config of the folder shares optimizer, schedule, budget, rounds and data with the others."""
    differences, stale = folder_differences(ROOT / folder, ALLOWED.get(folder, {}))
    assert not differences and not stale, report(ROOT / folder, differences, stale)
