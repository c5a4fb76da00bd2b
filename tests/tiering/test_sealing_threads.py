"""Large sealed blocks are sealed and opened on the sealing threads, off the event loop
(`tiering.tier.envelope.SEAL_IN_THREADS`), with the same results as on the loop: round trips
through `put`, `put_many`, `get` and `get_many`, GMAC and encrypted alike, and an altered object
a counted miss."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from tests.tiers.memory_hooks import plant, stored
from tiering.testing import SECRET, key, payload
from tiering.testing.data import NAMESPACE
from tiering.tier import Envelope, Tier
from tiering.tier.envelope import SEAL_IN_THREADS
from tiers.memory import MemoryTier


@pytest.mark.parametrize("encrypt", [False, True])
def test_large_sealed_blocks_are_sealed_and_opened_off_the_loop(
    encrypt: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    where: dict[str, set[str]] = {"seal": set(), "open_into": set()}
    for name in where:
        original = getattr(Envelope, name)

        def spy(self: Envelope, *args: Any, _name: str = name, _f: Any = original) -> Any:
            where[_name].add(threading.current_thread().name)
            return _f(self, *args)

        monkeypatch.setattr(Envelope, name, spy)
    monkeypatch.setattr(Tier, "seal_in_threads", SEAL_IN_THREADS)  # as with cores to spare
    big, small = SEAL_IN_THREADS, SEAL_IN_THREADS // 4

    async def go() -> None:
        loop_thread = threading.current_thread().name
        async with MemoryTier(namespace=NAMESPACE, secret=SECRET, encrypt=encrypt) as tier:
            blocks = {i: payload(big, i) for i in range(4)}
            await tier.put(key(0), blocks[0])
            assert await tier.put_many([(key(i), blocks[i]) for i in (1, 2, 3)]) == [None] * 3
            into = bytearray(big)
            assert await tier.get(key(0), into) and into == blocks[0]
            buffers = [bytearray(big) for _ in range(3)]
            asked = [(key(i), b) for i, b in zip((1, 2, 3), buffers, strict=True)]
            found = await tier.get_many(asked)
            assert found == [True] * 3 and buffers == [blocks[1], blocks[2], blocks[3]]
            assert where["seal"] and where["open_into"]
            assert loop_thread not in where["seal"] | where["open_into"], where
            assert all(name.startswith("kvtier-seal") for name in where["seal"]), where
            altered = bytearray(stored(tier, key(0)) or b"")
            altered[-1] ^= 1
            plant(tier, key(0), bytes(altered))
            assert await tier.get(key(0), bytearray(big)) is False
            assert tier.counters["corrupt.auth"] + tier.counters["corrupt.checksum"] == 1
            for name in where:
                where[name].clear()
            await tier.put(key(9), payload(small, 9))
            assert await tier.get_bytes(key(9), small) == payload(small, 9)
            assert where["seal"] == where["open_into"] == {loop_thread}, where

    asyncio.run(go())
