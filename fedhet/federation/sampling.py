"""Client sampling per round: all clients, a fraction, or a fixed count; seeded per round."""

from __future__ import annotations

import math

import torch

from fedhet.errors import ConfigError
from fedhet.seeding import derive_seed


def clients_per_round(num_clients: int, participation: float | int) -> int:
    """Number of clients a round samples.

    ``participation`` is a fraction in ``(0, 1]`` when it is a float (``1.0``: everyone; HtFLlib's
    ``-jr``) and a count when it is an int (``5``: five clients per round).
    """
    if isinstance(participation, bool):
        raise ConfigError("federation.participation must be a fraction (float) or a count (int), not a bool")
    if isinstance(participation, int):
        if not 1 <= participation <= num_clients:
            raise ConfigError(
                f"federation.participation={participation} clients per round, but the scenario has "
                f"{num_clients} clients; use a count in 1..{num_clients} or a fraction like 0.5"
            )
        return participation
    if not 0.0 < participation <= 1.0:
        raise ConfigError(f"federation.participation={participation}: a fraction must be in (0, 1]")
    return max(1, math.ceil(participation * num_clients - 1e-9))


def sample_clients(num_clients: int, participation: float | int, seed: int, round_idx: int) -> list[int]:
    """The sorted ids of the clients taking part in ``round_idx``.

    The draw depends only on ``(seed, round_idx)``, so a resumed run samples exactly what an
    uninterrupted one would.
    """
    count = clients_per_round(num_clients, participation)
    if count == num_clients:
        return list(range(num_clients))
    generator = torch.Generator().manual_seed(derive_seed(seed, "sample", round_idx))
    return sorted(torch.randperm(num_clients, generator=generator)[:count].tolist())
