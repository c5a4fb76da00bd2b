"""Routing a fleet replay's requests to its engines: `sticky` by session, `random` per request."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

from kvtier.trace import TraceRequest
from tiering.errors import ConfigError

__all__ = ["ROUTES", "SESSION_BLOCKS", "route_requests", "session_of"]

ROUTES = ("sticky", "random")
SESSION_BLOCKS = 2
"""Leading blocks that name a request's session for `sticky` routing (`session_of`)."""


def session_of(request: TraceRequest) -> tuple[int, ...]:
    """The session a request belongs to, for sticky routing: its first `SESSION_BLOCKS` block
    ids.

    The Mooncake traces carry no session or chat id, so stickiness comes from the prompt. Not
    from its first block alone: every request of the shipped trace starts with the same block
    (a system prompt), which would send the whole trace to one engine. A conversation's turns
    each extend the one before, so they share their first blocks, and the second block is
    where conversations part (7,373 sessions in the shipped trace, the largest of 43
    requests): a router hashing the first two blocks keeps each conversation on one engine,
    and requests that share both blocks share a prefix worth keeping together.
    """
    return request.hash_ids[:SESSION_BLOCKS]


def route_requests(
    requests: Sequence[TraceRequest], engines: int, route: str, seed: int = 0
) -> list[int]:
    """The engine (0 to `engines` - 1) of each request: `sticky`, a seeded hash of its
    session (a router's consistent choice, no state); `random`, a seeded RNG's pick per
    request. The same arguments give the same engines; `ConfigError` for an unknown route."""
    if route not in ROUTES:
        raise ConfigError(f"route: expected one of {', '.join(ROUTES)}, got {route!r}")
    if engines < 1:
        raise ConfigError(f"engines: expected at least 1, got {engines}")
    if route == "random":
        rng = random.Random(seed)
        return [rng.randrange(engines) for _ in requests]
    salt = hashlib.blake2b(str(seed).encode(), digest_size=16).digest()
    out = []
    for request in requests:
        ids = b"".join(i.to_bytes(8, "big") for i in session_of(request))
        digest = hashlib.blake2b(ids, digest_size=8, salt=salt).digest()
        out.append(int.from_bytes(digest, "big") % engines)
    return out
