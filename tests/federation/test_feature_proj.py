"""``--feature_proj``: the neck to ``--feature_dim`` is HtFLlib's parameter-free pooling or a learnable Linear.

FedVTC gives every client a learnable ``Linear`` neck to p = 980; its baselines in
``configs/experiments/mnist_vtc/`` ship HtFLlib's pooling to the same p. ``--feature_proj linear``
gives the baselines FedVTC's neck, so a comparison (``configs/grids/fedvtc_tuned.yaml``) can
compare methods on the same networks.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from torch import nn

from fedhet.config import build_experiment, build_objects_from_yaml, parse_args
from fedhet.federation import MemoryStateStore
from fedhet.federation.runtime import RuntimeRecipe
from tests.conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/experiments/mnist_vtc/fedproto.yaml"


def loop_of(*flags: str):
    """The round loop of the FedVTC page's FedProto config, shrunk to tiny2 models and 3 clients."""
    args = ["--config", str(CONFIG), *tiny_overrides("label_skew"), "--federation.executor=sequential",
            "--feature_dim=16", *flags]  # fmt: skip
    parser, config = parse_args(args)
    experiment = build_experiment(parser, config, logging_run=False)
    return parser, config, experiment.build_loop(MemoryStateStore(), parser.dump(config, skip_none=False))


@pytest.mark.parametrize("proj", ["pool", "linear"])
def test_feature_proj_builds_that_neck_on_every_backbone(proj):
    """cnn_tiny (16 features) and mlp_tiny (32) to 16: pooling has no weights; Linear has 32 x 16 + 16 = 528."""
    flags = () if proj == "pool" else ("--feature_proj=linear",)
    _, _, loop = loop_of(*flags)
    cnn, mlp = loop.runtime.module("cnn_tiny").model, loop.runtime.module("mlp_tiny").model
    assert (cnn.num_backbone_features, mlp.num_backbone_features) == (16, 32)
    assert isinstance(cnn.neck, nn.Identity)  # native size already 16: nothing to add
    assert mlp.num_features == 16
    if proj == "pool":
        assert isinstance(mlp.neck, nn.AdaptiveAvgPool1d)
        assert sum(p.numel() for p in mlp.neck.parameters()) == 0
    else:
        assert isinstance(mlp.neck, nn.Linear)
        assert sum(p.numel() for p in mlp.neck.parameters()) == 32 * 16 + 16
    assert loop.recipe.feature_proj == proj


def test_workers_rebuild_the_same_neck_from_the_recipe():
    """A process worker's runtime (rebuilt from the pickled recipe) gets the linear neck too."""
    parser, config, _ = loop_of("--feature_proj=linear")
    recipe = RuntimeRecipe(architectures=("cnn_tiny", "mlp_tiny", "cnn_tiny"), seed=0, rounds=1, feature_dim=16,
                           feature_proj="linear", config_yaml=parser.dump(config, skip_none=False),
                           rebuild=build_objects_from_yaml)  # fmt: skip
    runtime = pickle.loads(pickle.dumps(recipe)).build()
    assert isinstance(runtime.module("mlp_tiny").model.neck, nn.Linear)


def test_unknown_feature_proj_is_refused():
    """Only pool and linear exist."""
    with pytest.raises((SystemExit, Exception)):
        parse_args(["--config", str(CONFIG), "--feature_proj=conv"])


def test_fedvtc_keeps_the_linear_neck_the_flags_build():
    """FedVTC given ``--feature_dim=p --feature_proj=linear`` trains the networks it builds without them.

    At 16 px FedVTC's latent is 20 x 4 x 4, p = 320: every backbone gets Linear(native, 320) either way (mlp_tiny:
    32 x 320 + 320 = 10,560 weights), so the tuned FedVTC page, which passes the flags to every row, changes
    only the baselines' necks.
    """
    config = ROOT / "configs/experiments/mnist_vtc/fedvtc.yaml"
    common = ["--config", str(config), *tiny_overrides("label_skew"), "--federation.executor=sequential"]
    counts = []
    for flags in ([], ["--feature_dim=320", "--feature_proj=linear"]):
        parser, parsed = parse_args([*common, *flags])
        loop = build_experiment(parser, parsed, logging_run=False).build_loop(MemoryStateStore())
        model = loop.runtime.module("mlp_tiny").model
        assert isinstance(model.neck, nn.Linear) and (model.neck.in_features, model.neck.out_features) == (32, 320)
        assert sum(p.numel() for p in model.neck.parameters()) == 32 * 320 + 320
        counts.append(sum(p.numel() for p in model.parameters()))
    assert counts[0] == counts[1]
