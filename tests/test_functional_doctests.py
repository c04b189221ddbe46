"""The ``Example:`` blocks of ``fedhet.functional`` run as tests, one test per docstring.

The examples are hand-computed values of the losses the method oracles rely on, so a docstring
whose numbers went stale must fail ``python -m pytest`` rather than mislead a reader. Running
them from here (the standard library's ``doctest``, no ``--doctest-modules``) leaves the
collection of every other file unchanged; ``python -m pytest --doctest-modules fedhet/functional``
runs the same examples.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import fedhet.functional

MODULES = sorted(f"fedhet.functional.{info.name}" for info in pkgutil.iter_modules(fedhet.functional.__path__))


def examples() -> list[tuple[str, doctest.DocTest]]:
    """Every docstring with at least one example, in every ``fedhet.functional`` module."""
    finder = doctest.DocTestFinder(exclude_empty=True)
    found = []
    for name in MODULES:
        module = importlib.import_module(name)
        for test in finder.find(module, name):
            if test.examples and test.name.startswith(name):  # defined here, not re-exported
                found.append((test.name, test))
    return sorted(found, key=lambda item: item[0])


EXAMPLES = examples()


def test_functional_has_examples():
    """The docstrings carry examples (a refactor that drops them all would otherwise pass silently)."""
    assert len(EXAMPLES) >= 20, f"only {len(EXAMPLES)} docstrings with examples in fedhet.functional"


@pytest.mark.parametrize("test", [t for _, t in EXAMPLES], ids=[n for n, _ in EXAMPLES])
def test_docstring_example(test, one_thread_doctest):
    """Each example prints exactly what its docstring shows."""
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    output: list[str] = []
    result = runner.run(test, out=output.append, clear_globs=False)
    assert result.failed == 0, "".join(output)


@pytest.fixture
def one_thread_doctest():
    """One intra-op thread: printed values are rounded, but sums in another order can flip a last digit."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
