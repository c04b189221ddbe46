"""Shared fixtures of the data tests: a private cache directory and one embedded build."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fedhet.data.embedded import load_embedded
from fedhet.data.tensors import DomainSplits


@pytest.fixture(scope="session", autouse=True)
def fedhet_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point FEDHET_CACHE at a session temp dir so no test writes to the home directory."""
    cache = tmp_path_factory.mktemp("fedhet-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FEDHET_CACHE", str(cache))
        yield cache


@pytest.fixture(scope="package", autouse=True)
def _one_thread() -> Iterator[None]:
    """The test machines are small and shared: data tests use one intra-op thread.

    The previous count is restored afterwards: results of training depend on the thread count
    (floating-point reduction order), and other test packages compare runs across processes.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def embedded(fedhet_cache: Path) -> dict[str, DomainSplits]:
    """The full embedded build for seed 0 (built once per session, then cached)."""
    return load_embedded(0)
