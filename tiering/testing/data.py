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


def payload(size: int, seed: int = 0) -> bytes:
    """Deterministic, incompressible bytes."""
    return random.Random(seed * 1_000_003 + size).randbytes(size)
