"""Hyperparameters declared once: every registered method's declaration, and no drift between its parts.

A method declares its hyperparameters in one frozen dataclass; its Algorithm's signature, its
client and its server read that declaration. These tests hold every registered method to it: a
client (and a server) built alone has exactly the hyperparameters its Algorithm gives it with
defaults, the command line's signature is the declaration, and every knob says what it means.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from fedhet.algorithms import ALGORITHMS, list_algorithms
from fedhet.algorithms.base import Algorithm, ServerPlugin
from fedhet.errors import ConfigError
from fedhet.hparams import Hyperparameters, LocalOptimizer, NonNegativeFloat, knob, knobs, sweep_parameters
from tests.algorithms.helpers import tiny_loop


@pytest.mark.parametrize("name", list_algorithms())
def test_declaration_is_the_signature(name):
    """The Algorithm's keyword arguments are its declared knobs (plus a plugin's ``base``), each with a meaning."""
    method = ALGORITHMS[name]
    assert issubclass(method.Hparams, Hyperparameters)
    assert method.Hparams.__dataclass_params__.frozen  # type: ignore[attr-defined]
    declared = [k.name for k in knobs(method.Hparams)]
    extra = ["base"] if issubclass(method, ServerPlugin) else []
    assert list(inspect.signature(method).parameters) == extra + declared
    assert all(k.help for k in knobs(method.Hparams)), f"{name}: every knob needs its one-line meaning"
    assert dataclasses.asdict(method().hp) == dataclasses.asdict(method.Hparams())


@pytest.mark.parametrize("name", list_algorithms())
def test_client_and_server_built_alone_match_the_algorithm(name, cpu_trainer):
    """Defaults cannot drift: a client or server built with no arguments holds what the default Algorithm gives it."""
    method = ALGORITHMS[name]
    defaults = {k.name: k.default for k in knobs(method.Hparams)}
    cheap = {key: defaults[key] for key in ("pretrain_epochs",) if key in defaults}
    loop = tiny_loop(name, trainer=cpu_trainer, method_args=cheap)
    loop.algorithm = method(**cheap)
    client = loop.algorithm.build_client(loop.runtime.module(loop.architectures[0], slot=0).model, 2)
    alone = type(client).Hparams()
    assert dataclasses.asdict(client.hp) == dataclasses.asdict(alone)
    server = loop.algorithm.build_server()
    for part in (server, getattr(server, "base", None), getattr(server, "refinement", None)):
        if part is not None and hasattr(type(part), "Hparams") and hasattr(part, "hp"):
            assert dataclasses.asdict(part.hp) == dataclasses.asdict(type(part).Hparams()), type(part).__name__


def test_out_of_range_values_are_refused_from_python_too():
    """The ranges the parser enforces hold for Python callers, naming the method, the key and the range."""
    with pytest.raises(ConfigError, match=r"FedProx: mu=-1 is not a number >= 0"):
        ALGORITHMS["fedprox"](mu=-1)
    with pytest.raises(ConfigError, match="FedProx: .*unexpected keyword argument 'mew'.*mu"):
        ALGORITHMS["fedprox"](mew=0.1)
    with pytest.raises(ConfigError, match="one of 'sgd', 'adam', 'adamw'"):
        LocalOptimizer(optimizer="rmsprop")


def test_search_space_is_read_from_the_declaration():
    """The tuning stage's sweep parameters are the declared search spaces, under the config's keys."""
    space = sweep_parameters(ALGORITHMS["fedprox"].Hparams)
    assert space == {
        "method.init_args.lr": {"distribution": "log_uniform_values", "min": 1e-4, "max": 1.0},
        "method.init_args.mu": {"distribution": "log_uniform_values", "min": 1e-4, "max": 1.0},
    }


def test_generated_constructor_is_the_declaration_with_its_meanings():
    """A class made at test time gets an ``__init__`` whose signature, annotations, names and docstring are exact.

    The classes are made inside the test so that the hook that builds constructors runs while the
    test does: a plain method, a plugin (its ``base`` first, with the hand-written constructor's
    annotation and the first line of its docstring), and a hand-written constructor whose
    subclasses start with its extra parameter.
    """

    @dataclasses.dataclass(frozen=True)
    class MixHparams(Hyperparameters):
        """Knobs declared in the test."""

        mix: NonNegativeFloat = knob(0.25, "share of the global model mixed in")
        rounds_kept: int = knob(3, "rounds a state is kept")

    class Mix(Algorithm):
        Hparams = MixHparams

    class MixPlugin(ServerPlugin):
        Hparams = MixHparams

    class Weighted(Algorithm):
        Hparams = MixHparams

        def __init__(self, weights: list[float], **values):
            """A method with one constructor argument besides its knobs.

            Args:
                weights: the per-client weights: one number per client
                **values: the knobs
            """
            super().__init__(**values)
            self.weights = weights

    class WeightedChild(Weighted):
        pass

    class Undocumented(Algorithm):
        Hparams = MixHparams

        def __init__(self, scale, **values):  # noqa: ANN001, D107 (no annotation, no docstring to copy)
            super().__init__(**values)

    class Mixin:
        def __init__(self, tag=None, **values):  # noqa: ANN001 (not an Algorithm's: the generated constructor skips it)
            super().__init__(**values)

    class MixedIn(Mixin, Mix):
        pass

    class UndocumentedChild(Undocumented):
        pass

    keyword = inspect.Parameter.KEYWORD_ONLY
    knobs_declared = [
        inspect.Parameter("mix", keyword, default=0.25, annotation=NonNegativeFloat),
        inspect.Parameter("rounds_kept", keyword, default=3, annotation=int),
    ]
    assert inspect.signature(Mix) == inspect.Signature(knobs_declared, return_annotation=None)
    assert Mix.__init__.__annotations__ == {"mix": NonNegativeFloat, "rounds_kept": int, "return": None}
    assert Mix.__init__.__qualname__.endswith("Mix.__init__") and Mix.__init__.__module__ == __name__
    assert Mix.__init__.__doc__ == (
        "Mix's hyperparameters (MixHparams).\n\n    Args:\n"
        "        mix: share of the global model mixed in\n        rounds_kept: rounds a state is kept"
    )
    assert Mix(mix=0.5).hp == MixHparams(mix=0.5, rounds_kept=3)

    base = inspect.Parameter("base", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None, annotation=Algorithm | None)
    assert inspect.signature(MixPlugin) == inspect.Signature([base, *knobs_declared], return_annotation=None)
    assert MixPlugin.__init__.__doc__.splitlines()[3] == (
        "        base: the weight-averaging base method whose clients and averaging the plugin refines"
    )
    assert MixPlugin(mix=0.0).base.name == "FedAvg"

    weights = inspect.Parameter("weights", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=list[float])
    assert inspect.signature(WeightedChild) == inspect.Signature([weights, *knobs_declared], return_annotation=None)
    weights_line = "        weights: the per-client weights: one number per client"  # its own colon kept
    assert WeightedChild.__init__.__doc__.splitlines()[3] == weights_line
    assert UndocumentedChild.__init__.__doc__.splitlines()[3] == "        scale: "  # no made-up meaning
    scale = inspect.signature(UndocumentedChild).parameters["scale"]
    assert scale.annotation is inspect.Parameter.empty  # none given, none made up
    assert list(inspect.signature(Mix.__init__).parameters)[:2] == ["self", "mix"]
    assert inspect.signature(MixedIn) == inspect.Signature(knobs_declared, return_annotation=None)
    assert MixedIn(mix=0.5).hp == MixHparams(mix=0.5, rounds_kept=3)
    child = WeightedChild([0.5, 0.5], rounds_kept=1)
    assert (child.weights, child.hp.rounds_kept) == ([0.5, 0.5], 1)
    with pytest.raises(ConfigError, match=r"WeightedChild: .*'mixx'.*its hyperparameters: mix, rounds_kept"):
        WeightedChild([1.0], mixx=0.1)
