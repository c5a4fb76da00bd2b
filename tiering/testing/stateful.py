"""A Hypothesis state machine that drives one tier with random calls and checks it against a
dict model after every step, as zarr's `testing/stateful.py` does for stores (test process: the
tier's calls run on the machine's own event loop).

    run_state_machine_as_test(lambda: TierStateMachine(make_tier))

`make_tier()` is called on that loop and may hand back a tier on storage that earlier examples
used: the machine first deletes every key it draws from (`KEYS`), so the model starts empty.
The tier is made without a capacity, so nothing is evicted behind the model's back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tiering.keys import BlockKey
from tiering.testing.data import key, payload
from tiering.tier import Tier

__all__ = ["KEYS", "TierStateMachine"]

T = TypeVar("T")

KEYS = [key(i, group=i % 2) for i in range(6)]
"""The keys the machine uses: few, so that calls meet the same keys again."""
keys = st.sampled_from(KEYS)
blocks = st.tuples(st.sampled_from([0, 1, 100, 4096, 65536]), st.integers(0, 3))
"""(size, seed) of a block's payload."""


class TierStateMachine(RuleBasedStateMachine):
    """Random puts, gets, deletes, existence checks and listings of one tier, each compared
    with a dict of what it must hold (test process, the machine's own event loop)."""

    def __init__(self, make_tier: Callable[[], Tier]) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.model: dict[BlockKey, bytes] = {}
        self.tier = self.run(self._open(make_tier))

    async def _open(self, make_tier: Callable[[], Tier]) -> Tier:
        tier = make_tier()
        for result in await tier.delete_many(KEYS):
            if isinstance(result, BaseException):
                raise result
        return tier

    def run(self, call: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(call)

    @rule(k=keys, block=blocks)
    def put(self, k: BlockKey, block: tuple[int, int]) -> None:
        data = payload(*block)
        before = self.tier.counters["duplicates"]
        self.run(self.tier.put(k, data))
        self._stored(k, data, self.tier.counters["duplicates"] - before)

    @rule(items=st.lists(st.tuples(keys, blocks), max_size=4, unique_by=lambda item: item[0]))
    def put_many(self, items: list[tuple[BlockKey, tuple[int, int]]]) -> None:
        batch = [(k, payload(*block)) for k, block in items]
        before = self.tier.counters["duplicates"]
        assert self.run(self.tier.put_many(batch)) == [None] * len(batch)
        duplicates = self.tier.counters["duplicates"] - before
        assert duplicates == sum(k in self.model for k, _ in batch) or duplicates == 0
        for k, data in batch:
            self._stored(k, data, duplicates)

    def _stored(self, k: BlockKey, data: bytes, duplicates: int) -> None:
        """What the model holds after a put: the new block, or, on a store that writes a key
        once and counted the put as a duplicate, the block it held."""
        if not (duplicates and k in self.model):
            self.model[k] = data

    @rule(k=keys)
    def get(self, k: BlockKey) -> None:
        expected = self.model.get(k)
        size = 64 if expected is None else len(expected)  # the right size: no refusal
        assert self.run(self.tier.get_bytes(k, size)) == expected

    @rule(ks=st.lists(keys, max_size=4, unique=True))
    def get_many(self, ks: list[BlockKey]) -> None:
        buffers = [bytearray(len(self.model.get(k, b"?" * 64))) for k in ks]
        found = self.run(self.tier.get_many(list(zip(ks, buffers, strict=True))))
        assert found == [k in self.model for k in ks]
        for k, buffer in zip(ks, buffers, strict=True):
            if k in self.model:
                assert bytes(buffer) == self.model[k]

    @rule(k=keys)
    def delete(self, k: BlockKey) -> None:
        assert self.run(self.tier.delete(k)) == (k in self.model)
        self.model.pop(k, None)

    @rule(ks=st.lists(keys, max_size=6))
    def contains(self, ks: list[BlockKey]) -> None:
        assert self.run(self.tier.contains(ks)) == [k in self.model for k in ks]

    @rule()
    def listing(self) -> None:
        if self.tier.supports_listing:
            assert self.run(self._keys()) == set(self.model)

    async def _keys(self) -> set[BlockKey]:
        return {k async for k in self.tier.keys()}

    @invariant()
    def nothing_was_refused(self) -> None:
        refused = {n: v for n, v in self.tier.counters.items() if n.startswith("corrupt.")}
        assert not refused, refused

    def teardown(self) -> None:
        try:
            self.run(self.tier.close())
        finally:
            self.loop.close()
