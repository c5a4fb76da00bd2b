"""Deterministic test data: the namespaces, secrets, keys and payloads of the conformance
suite, for tests and benchmarks alike (`kvtier bench` imports this module: it imports no
pytest and nothing beyond kvtier's own dependencies)."""

from __future__ import annotations

import random

from tiering.keys import BlockKey, make_key

__all__ = ["NAMESPACE", "OTHER_NAMESPACE", "OTHER_SECRET", "SECRET", "key", "payload"]

NAMESPACE = bytes(range(16))
OTHER_NAMESPACE = bytes(range(1, 17))
SECRET = b"kvtier-conformance-secret"
OTHER_SECRET = b"someone-else's-secret-entirely"


def key(i: int, group: int = 0) -> BlockKey:
    """The block key numbered `i` (of KV group `group`)."""
    return make_key(i.to_bytes(4, "big") + bytes(28), group)


_ONE_DRAW = 1 << 27
"""The most bytes drawn at once: `randbytes` draws `8 * n` bits as one C int (at most 2**31 - 1),
so 256 MiB or more in one draw raises OverflowError."""


def payload(size: int, seed: int = 0) -> bytes:
    """Deterministic, incompressible bytes, of any size (drawn `_ONE_DRAW` at a time past it:
    smaller payloads are one draw, as they always were)."""
    rng = random.Random(seed * 1_000_003 + size)
    if size <= _ONE_DRAW:
        return rng.randbytes(size)
    return b"".join(rng.randbytes(min(_ONE_DRAW, size - at)) for at in range(0, size, _ONE_DRAW))
