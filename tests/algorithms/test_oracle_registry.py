"""Every registered method has a one-step oracle (``tests/algorithms/test_oracle_*.py``).

Each oracle module declares the registry names it checks in a module-level ``ORACLE_COVERS``
set; this test reads those sets (by parsing the files, so it costs no import of the heavy
oracle modules) and compares their union with ``fedhet.catalog.METHODS``. A method added to
the registry without an oracle fails here by name, with the fix in the message.

``AWAITING_ORACLE`` lists the registered methods whose oracle is not written yet. It may only
shrink: a name in it that gained an oracle, or that is no longer registered, fails too, so the
list stays the exact backlog.
"""

from __future__ import annotations

import ast
from pathlib import Path

from fedhet.catalog import METHODS

HERE = Path(__file__).parent

#: Registered methods without a one-step oracle yet (the backlog; remove a name when its oracle lands).
AWAITING_ORACLE: frozenset[str] = frozenset()  # every registered method has its oracle (2026-11-27)


def declared_covers() -> dict[str, set[str]]:
    """``{oracle file name: its ORACLE_COVERS}``, read from the source (a literal set of strings)."""
    covers: dict[str, set[str]] = {}
    for path in sorted(HERE.glob("test_oracle_*.py")):
        if path.name == Path(__file__).name:
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "ORACLE_COVERS" for t in node.targets
            ):
                covers[path.name] = set(ast.literal_eval(node.value))
    return covers


def test_every_oracle_module_declares_what_it_covers():
    """A ``test_oracle_*.py`` without ``ORACLE_COVERS`` (or with a name not registered) is an error."""
    covers = declared_covers()
    files = {p.name for p in HERE.glob("test_oracle_*.py")} - {Path(__file__).name}
    undeclared = sorted(files - set(covers))
    assert not undeclared, f"{undeclared}: add ORACLE_COVERS = {{'<method>', ...}} naming the methods each checks"
    for name, methods in covers.items():
        unknown = sorted(methods - set(METHODS))
        assert not unknown, f"{name} covers {unknown}, which are not registered methods (see `python -m fedhet list`)"


def test_every_registered_method_has_a_one_step_oracle():
    """The union of ``ORACLE_COVERS`` plus the backlog is exactly the registry."""
    covered = set().union(*declared_covers().values())
    registered = set(METHODS)
    missing = sorted(registered - covered - AWAITING_ORACLE)
    assert not missing, (
        f"registered methods without a one-step oracle: {missing}; write tests/algorithms/test_oracle_<method>.py "
        "(or add them to a grouped oracle file) and name them in its ORACLE_COVERS"
    )
    stale = sorted(AWAITING_ORACLE & covered)
    assert not stale, f"{stale} now have oracles: remove them from AWAITING_ORACLE in {Path(__file__).name}"
    gone = sorted(AWAITING_ORACLE - registered)
    assert not gone, f"{gone} are not registered any more: remove them from AWAITING_ORACLE in {Path(__file__).name}"
