"""Tiers that wrap a tier: one forwarding base, and the fault injector built on it.

A wrapper forwards the *primitives* of the tier it wraps, so the wrapper's own base class does
the encoding, verification, deadlines and counting: a corruption injected below is caught above
exactly as a corrupt object on a real device would be.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import AsyncIterator, Sequence
from typing import Any

from tiering.errors import TierUnavailable
from tiering.keys import BlockKey
from tiering.tier.base import Tier
from tiering.tier.contract import CAPABILITIES
from tiering.tier.values import Buffer, NamespaceUsage, TierStat

__all__ = ["FaultyTier", "ForwardingTier"]


class ForwardingTier(Tier):
    """Forwards every primitive to `inner`, on the thread `inner` runs on (the runtime's
    event loop), with the same namespace and capabilities.

    Settings not given default to `inner`'s name, capacity, codec, read-only mode and timeout;
    without a `secret`, the wrapper verifies with `inner`'s."""

    def __init__(self, inner: Tier, **options: Any) -> None:
        options.setdefault("name", inner.name)
        options.setdefault("capacity", inner.capacity)
        options.setdefault("codec", inner.codec)
        options.setdefault("read_only", inner.read_only)
        options.setdefault("timeout", inner.timeout)
        super().__init__(namespace=inner.namespace, **options)
        self.inner = inner
        # One set of counters: the wrapper counts calls, the wrapped tier its own events
        # (evictions), and only its primitives are called, so nothing is counted twice.
        self.counters = inner.counters
        # Capabilities are the wrapped tier's (`writes_once`: its `_write` answers the
        # wrapper's puts).
        for name in CAPABILITIES:
            setattr(self, name, getattr(inner, name))
        # The wrapper encodes and verifies: at inner's alignment, and with inner's secret
        # unless it was given its own.
        self.envelope = dataclasses.replace(self.envelope, align=inner.align)
        if "secret" not in options:
            self.use_secret_of(inner)

    def _knows(self, key: BlockKey) -> bool | None:
        return self.inner.knows(key)

    def newest(self, n: int) -> list[BlockKey]:
        return self.inner.newest(n)

    def _served(self, key: BlockKey) -> None:
        self.inner._served(key)

    async def _read(self, key: BlockKey, limit: int) -> Buffer | None:
        return await self.inner._read(key, limit)

    async def _read_head(self, key: BlockKey, n: int) -> tuple[Buffer, int] | None:
        return await self.inner._read_head(key, n)

    async def _write(self, key: BlockKey, parts: Sequence[Buffer]) -> bool | None:
        return await self.inner._write(key, parts)

    async def _delete(self, key: BlockKey) -> bool:
        return await self.inner._delete(key)

    async def _delete_refused(self, key: BlockKey, seen: bytes | None) -> bool:
        return await self.inner._delete_refused(key, seen)

    async def _contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        return await self.inner._contains(keys)

    async def _stat(self) -> TierStat:
        return await self.inner._stat()

    async def _usage(self) -> list[NamespaceUsage]:
        return await self.inner._usage()

    async def _list(self) -> AsyncIterator[BlockKey]:
        async for key in self.inner._list():
            yield key

    async def _namespaces(self) -> list[bytes]:
        return await self.inner._namespaces()

    async def _read_record(self, name: str, limit: int) -> Buffer | None:
        return await self.inner._read_record(name, limit)

    async def _write_record(self, name: str, blob: bytes) -> bool:
        return await self.inner._write_record(name, blob)

    async def _delete_record(self, name: str) -> bool:
        return await self.inner._delete_record(name)

    async def _list_records(self, prefix: str, limit: int) -> list[str]:
        return await self.inner._list_records(prefix, limit)

    async def _close(self) -> None:
        await self.inner.close()


class FaultyTier(ForwardingTier):
    """Injects faults into the tier it wraps, on its thread (the runtime's event loop), each
    with a probability per call:

    - `drop`: a write is acknowledged but not stored; a read finds nothing;
    - `delay`: the call first sleeps `delay_seconds` (past a deadline, it times out);
    - `corrupt`: a read returns the object with one byte flipped;
    - `fail`: the call raises `TierUnavailable`.

    `seed` makes a run repeatable. Faults can be changed between calls (`tier.fail = 1.0`).
    """

    def __init__(
        self,
        inner: Tier,
        *,
        drop: float = 0.0,
        delay: float = 0.0,
        delay_seconds: float = 1.0,
        corrupt: float = 0.0,
        fail: float = 0.0,
        seed: int | None = None,
        **options: Any,
    ) -> None:
        super().__init__(inner, **options)
        self.drop, self.delay, self.corrupt, self.fail = drop, delay, corrupt, fail
        self.delay_seconds = delay_seconds
        self.random = random.Random(seed)
        self.injected: dict[str, int] = {"drop": 0, "delay": 0, "corrupt": 0, "fail": 0}

    def _roll(self, fault: str, probability: float) -> bool:
        if probability and self.random.random() < probability:
            self.injected[fault] += 1
            return True
        return False

    async def _before(self, what: str) -> None:
        if self._roll("delay", self.delay):
            await asyncio.sleep(self.delay_seconds)
        if self._roll("fail", self.fail):
            raise TierUnavailable(f"tier {self.name!r}: injected failure of {what}")

    async def _read(self, key: BlockKey, limit: int) -> Buffer | None:
        await self._before("read")
        if self._roll("drop", self.drop):
            return None
        blob = await super()._read(key, limit)
        if blob is not None and len(blob) and self._roll("corrupt", self.corrupt):
            damaged = bytearray(blob)
            damaged[self.random.randrange(len(damaged))] ^= 0xFF
            return bytes(damaged)
        return blob

    async def _write(self, key: BlockKey, parts: Sequence[Buffer]) -> bool | None:
        await self._before("write")
        if self._roll("drop", self.drop):
            return None
        return await super()._write(key, parts)

    async def _delete(self, key: BlockKey) -> bool:
        await self._before("delete")
        return await super()._delete(key)

    async def _contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        await self._before("contains")
        return await super()._contains(keys)
