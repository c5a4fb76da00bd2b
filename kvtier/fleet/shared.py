"""The shared tier as each engine of a fleet replay sees it, and who wrote each of its blocks."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from tiering.keys import BlockKey
from tiering.tier import Buffer, Medium, Tier, TierStat
from tiering.tier.wrappers import ForwardingTier

__all__ = ["EngineTier", "Holds", "Write", "WriteLedger"]


@dataclass(frozen=True, slots=True)
class Write:
    """Any thread (a frozen value): one engine's write of a block, as the ledger records it."""

    engine: int
    seq: int
    """Order of the writes that ended (a later write of the same block has a larger one)."""


class WriteLedger:
    """Any thread (a lock guards its records): who wrote the object each block of the shared
    tier holds, and each engine's writes and duplicate writes.

    A store cannot say who wrote an object (the writer tag in the header belongs to another
    package), so the simulation records it: one entry per block written, bounded by the
    trace's distinct blocks."""

    def __init__(self, engines: int) -> None:
        self.lock = threading.Lock()
        self._writers: dict[BlockKey, Write] = {}
        self._seq = 0
        self.writes = [0] * engines
        """Blocks each engine wrote to the shared tier."""
        self.duplicates = [0] * engines
        """Of `writes`, those the store held from another engine already."""
        self.duplicate_bytes = [0] * engines

    def writer(self, key: BlockKey) -> int | None:
        """The engine whose write of `key` the store holds, as far as the ledger knows (None:
        none on record; the store may have evicted it since)."""
        write = self._writers.get(key)
        return None if write is None else write.engine

    def last(self, key: BlockKey) -> Write | None:
        """The last write of `key` that ended (None: none)."""
        with self.lock:
            return self._writers.get(key)

    def wrote(
        self,
        engine: int,
        key: BlockKey,
        size: int,
        *,
        before: Write | None,
        held: bool,
        written: bool,
    ) -> None:
        """`engine`'s write of `key` (an object of `size` bytes) ended. A duplicate when the
        store held the block from another engine when it began (`held`; `before` the last
        write then), when another engine's write of it ended meanwhile, or when the store kept
        the object it had (`written` false: a tier that writes once)."""
        with self.lock:
            now = self._writers.get(key)
            raced = now is not None and now is not before and now.engine != engine
            self.writes[engine] += 1
            if held or raced or not written:
                self.duplicates[engine] += 1
                self.duplicate_bytes[engine] += size
            if written:
                self._seq += 1
                self._writers[key] = Write(engine, self._seq)


Holds = Callable[[BlockKey, Write], Awaitable[bool]]
"""Whether the store still holds the object of a block whose last write was `Write`."""


class EngineTier(ForwardingTier):
    """The runtime thread of engine `engine` (its event loop; `knows` from any): the shared
    tier as that engine sees it. Forwards every primitive to `inner` with counters of its own
    (the engine's calls; `inner` keeps its own events, its evictions), and records each write
    in `ledger`: before writing a block another engine wrote last, it asks whether the store
    still holds it (`holds`; default: `inner`'s index, else an existence check of `inner`).

    With `shared_lock`, `inner` is the one in-process tier every engine of the fleet uses (the
    memory tier standing in for a shared store): its calls are serialized under the lock
    (held through each call: the memory tier's primitives never suspend), it is closed by the
    fleet, not here, and it is seen without its index (`indexed` false, `knows` None), through
    existence checks, as each engine sees a remote store that others write to.
    """

    def __init__(
        self,
        inner: Tier,
        engine: int,
        ledger: WriteLedger,
        *,
        shared_lock: threading.Lock | None = None,
        holds: Holds | None = None,
    ) -> None:
        super().__init__(inner)
        self.engine = engine
        self.ledger = ledger
        self.counters = Counter()
        self._lock = shared_lock
        self._holds = holds or self._inner_holds
        if shared_lock is not None:
            self.indexed = False
            self.medium = Medium.REMOTE

    async def _inner_holds(self, key: BlockKey, last: Write) -> bool:
        known = self.inner.knows(key)
        if known is None:
            known = (await self.inner._contains([key]))[0]
        return bool(known)

    def _knows(self, key: BlockKey) -> bool | None:
        return None if self._lock is not None else self.inner.knows(key)

    def newest(self, n: int) -> list[BlockKey]:
        return [] if self._lock is not None else self.inner.newest(n)

    async def _serialized(self, call: Callable[[], Awaitable[Any]]) -> Any:
        if self._lock is None:
            return await call()
        with self._lock:
            return await call()

    async def _read(self, key: BlockKey, limit: int) -> Buffer | None:
        got = await self._serialized(lambda: self.inner._read(key, limit))
        return cast(Buffer | None, got)

    async def _read_head(self, key: BlockKey, n: int) -> tuple[Buffer, int] | None:
        got = await self._serialized(lambda: self.inner._read_head(key, n))
        return cast(tuple[Buffer, int] | None, got)

    async def _contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        return cast(list[bool], await self._serialized(lambda: self.inner._contains(keys)))

    async def _delete(self, key: BlockKey) -> bool:
        return cast(bool, await self._serialized(lambda: self.inner._delete(key)))

    async def _stat(self) -> TierStat:
        return cast(TierStat, await self._serialized(self.inner._stat))

    async def _write(self, key: BlockKey, parts: Sequence[Buffer]) -> None:
        await self._serialized(lambda: self._write_recorded(key, parts))

    async def _write_recorded(self, key: BlockKey, parts: Sequence[Buffer]) -> None:
        before = self.ledger.last(key)
        held = (
            before is not None and before.engine != self.engine and await self._holds(key, before)
        )
        # A backend that writes once answers False when it kept the object it held (the
        # `Tier._write` contract of a later package); None, today's answer, means written.
        answer = await cast("Awaitable[bool | None]", self.inner._write(key, parts))
        size = sum(len(part) for part in parts)
        self.ledger.wrote(
            self.engine, key, size, before=before, held=held, written=answer is not False
        )

    async def _close(self) -> None:
        if self._lock is None:
            await self.inner.close()
