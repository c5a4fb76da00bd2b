"""The conformance suite's store-down test (pytest): while a tier's store cannot be reached,
every call that needs it raises `TierUnavailable`, never a library's exception.

`FaultTests` is one of the sections `tiering.testing.tier.TierConformance` is made of; it uses
the backend's `store_down` hook.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

from tiering.errors import TierUnavailable
from tiering.testing.data import key, payload
from tiering.testing.hooks import MakeTier, StoreDown, TierHooks, asynctest

__all__ = ["FaultTests"]


async def _unavailable(name: str, call: Callable[[], Awaitable[object]]) -> None:
    """`call` raises `TierUnavailable`, or, a batch, answers it for every item."""
    try:
        answer = await call()
    except TierUnavailable:
        return
    if isinstance(answer, list) and all(isinstance(a, TierUnavailable) for a in answer):
        return
    raise AssertionError(f"{name} answered {answer!r} while the store was down")


class FaultTests(TierHooks):
    """A store going down (test process, each test on its own `asyncio.run` loop)."""

    @asynctest
    async def test_a_store_down_is_unavailable(
        self, make_tier: MakeTier, store_down: StoreDown
    ) -> None:
        """Inside `store_down`, `get`, `put`, `delete` and their batches raise
        `TierUnavailable`, a batch perhaps answering it for every item instead; `contains`,
        `stat` and a listing too, unless the tier answers them from its index, and a put too,
        unless the tier `writes_behind`. Nothing raises a library's exception."""
        size = 4096
        async with make_tier() as tier:
            await tier.put(key(1), payload(size, 1))
            store: dict[str, Callable[[], Awaitable[object]]] = {
                "get": lambda: tier.get(key(1), bytearray(size)),
                "get_many": lambda: tier.get_many([(key(1), bytearray(size))]),
                "delete": lambda: tier.delete(key(1)),
                "delete_many": lambda: tier.delete_many([key(1)]),
            }
            writes: dict[str, Callable[[], Awaitable[object]]] = {
                "put": lambda: tier.put(key(2), payload(size, 2)),
                "put_many": lambda: tier.put_many([(key(3), payload(size, 3))]),
            }
            maybe: dict[str, Callable[[], Awaitable[object]]] = {
                "contains": lambda: tier.contains([key(1)]),
                "stat": tier.stat,
            }
            if tier.supports_listing:

                async def listing() -> object:
                    return [k async for k in tier.keys()]

                maybe["keys"] = listing
            if not tier.indexed:
                store |= maybe
                maybe = {}
            if self.writes_behind:
                maybe |= writes
            else:
                store |= writes
            with store_down(tier):
                for name, call in store.items():
                    await _unavailable(name, call)
                for call in maybe.values():  # answered from memory, or refused
                    with contextlib.suppress(TierUnavailable):
                        await call()
