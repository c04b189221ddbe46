"""Deterministic seed derivation.

Every random stream in fedhet (client sampling, model initialisation, batch order, augmentation,
server phases) gets its own seed derived from the experiment seed and the stream's coordinates
(round, client id, purpose). Streams are therefore independent of execution order, which is what
makes a resumed run, a Ray run and a sequential run produce the same numbers.
"""

from __future__ import annotations

import hashlib


def derive_seed(*parts: int | str) -> int:
    """Return a 31-bit seed that depends only on ``parts`` (stable across processes and machines).

    Example:
        >>> derive_seed(0, "init", 3) == derive_seed(0, "init", 3)
        True
    """
    text = "/".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:4], "little") & 0x7FFFFFFF
