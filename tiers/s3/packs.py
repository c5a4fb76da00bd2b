"""Packs: several blocks in one S3 object, and the S3 tier's index of them (`Packs`, on the
runtime's event loop; its maps under a lock, readable from any thread).

The index says which pack holds each block (`where`); a hit reads only its byte range (ranged
GET). It is filled from the bucket's packs' own indexes (`read_listed`: the listings are
`tiers.s3.refresh.Refresher`'s, at the first call and then every `pack_refresh`), so packs
survive restarts and packs other engines write are found while both run. Blocks not yet packed
wait in memory (pending, each with the time it was held) until `tiers.s3.packer.Packer` writes
them (`write`): a full pack at once, a partial one within `pack_after`. A pack gone from the
bucket (swept, deleted) is forgotten when a read finds it gone (`drop`) or a full listing no
longer lists it (`prune`): an index that names a removed pack costs a miss, never an error.
Deleting a packed block forgets it in this process; the pack object itself goes when all the
blocks this process knows in it are deleted.

Anyone who can write to the bucket can plant a pack, so what the index costs is bounded: a pack
whose index is beyond `tiers.s3.packformat`'s bounds or not what kvtier writes is ignored and
counted (`packs_refused`, once per pack), and at most `MAX_PACKED` blocks, packs and refused
names are held from the bucket in all.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator

from tiering.errors import TierError, TierTimeout, TierUnavailable
from tiering.keys import BlockKey
from tiers.s3.client import Bucket
from tiers.s3.packformat import (
    MAX_PACK_INDEX,
    PACK_HEAD,
    encode_index,
    pack_entries,
    pack_name,
)

__all__ = ["MAX_PACKED", "PACK_LOADS", "Packs", "Place"]

log = logging.getLogger(__name__)

MAX_PACKED = 2_000_000
"""Blocks, packs and refused pack names the tier holds from the bucket's packs, in all (one
entry costs ~300 bytes of memory): the packs beyond are refused. Packs this process writes
count towards it but are never refused."""
PACK_LOADS = 8
"""Pack indexes read at once (through the tier's thread pool) while loading."""

Place = tuple[str, int, int]
"""Where a packed block's object lies: (pack name, offset, length)."""
Held = tuple[bytes, float]
"""A block waiting for a pack: (its object, the monotonic time it was first held)."""


class Packs:
    """The S3 tier's packs: which pack holds each block, the blocks waiting for a pack or in a
    pack being written, the live blocks of each pack. Runs on the runtime's event loop; the
    maps are guarded by a lock, so any thread may read them."""

    def __init__(
        self,
        bucket: Bucket,
        base: str,
        tier: str,
        counters: Counter[str],
        blocks_per_object: int,
        writer: bytes,
    ) -> None:
        """`base`: the namespace's prefix in the bucket; `tier`: the tier's name (messages);
        `counters`: the tier's counters (`packs_refused`); `writer`: the tier's id (in the
        names of the packs it writes)."""
        self.bucket = bucket
        self.prefix = f"{base}packs/"
        self.tier = tier
        self.counters = counters
        self.blocks_per_object = blocks_per_object
        self.writer = writer
        self._lock = threading.Lock()
        self._packed: dict[BlockKey, Place] = {}
        self._pending: dict[BlockKey, Held] = {}  # oldest first
        self._flying: dict[BlockKey, Held] = {}  # in a pack being written
        self._pack_members: dict[str, set[BlockKey]] = {}
        self._refused: set[str] = set()
        self._count = itertools.count()
        self._bound_logged = False

    # -- the maps -------------------------------------------------------------------------------

    def where(self, key: BlockKey) -> tuple[bytes | None, Place | None]:
        """The object of `key` not yet in a written pack, and where its packed one lies
        (either may be None)."""
        with self._lock:
            held = self._pending.get(key) or self._flying.get(key)
            return None if held is None else held[0], self._packed.get(key)

    def known(self, keys: list[BlockKey]) -> list[bool]:
        """Whether each key is held or packed."""
        with self._lock:
            return [k in self._pending or k in self._flying or k in self._packed for k in keys]

    def packed(self, key: BlockKey) -> bool:
        """Whether the index knows a pack holding `key` (this engine's or another's)."""
        return key in self._packed

    def hold(self, key: BlockKey, blob: bytes) -> None:
        """Keep `blob` as the pending object of `key` (a key already pending keeps its place
        and its time: it is written as soon as it would have been)."""
        with self._lock:
            old = self._pending.get(key)
            self._pending[key] = (blob, time.monotonic() if old is None else old[1])

    def held(self) -> int:
        """Blocks held in memory: pending, or in a pack being written."""
        with self._lock:
            return len(self._pending) + len(self._flying)

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def due(self, after: float) -> dict[BlockKey, bytes] | None:
        """The next pack to write, taken from the pending blocks (oldest first, at most
        `blocks_per_object`), if one is due: as many as a pack holds, or the oldest held
        `after` seconds. They are in flight until `write` ends."""
        with self._lock:
            if not self._pending:
                return None
            oldest = next(iter(self._pending.values()))[1]
            if len(self._pending) < self.blocks_per_object and time.monotonic() - oldest < after:
                return None
            return self._take(self.blocks_per_object)

    def wait_for(self, after: float) -> float | None:
        """Seconds until the oldest pending block is due (0: now), None when none is pending."""
        with self._lock:
            if not self._pending:
                return None
            if len(self._pending) >= self.blocks_per_object:
                return 0.0
            oldest = next(iter(self._pending.values()))[1]
        return max(0.0, oldest + after - time.monotonic())

    def take_all(self) -> list[dict[BlockKey, bytes]]:
        """Every pending block, as packs of at most `blocks_per_object` (in flight after)."""
        batches = []
        with self._lock:
            while self._pending:
                batches.append(self._take(self.blocks_per_object))
        return batches

    def _take(self, n: int) -> dict[BlockKey, bytes]:
        taken = dict(itertools.islice(self._pending.items(), n))
        for key in taken:
            del self._pending[key]
        self._flying.update(taken)
        return {key: blob for key, (blob, _) in taken.items()}

    def forget(self, key: BlockKey) -> tuple[bool, str | None]:
        """Forget `key`'s pending and packed objects: whether there was one, and the pack that
        now holds no live block (to delete), if any."""
        forgotten = False
        empty_pack = None
        with self._lock:
            if self._pending.pop(key, None) is not None:
                forgotten = True
            if self._flying.pop(key, None) is not None:
                forgotten = True
            packed = self._packed.pop(key, None)
            if packed is not None:
                forgotten = True
                members = self._pack_members.get(packed[0], set())
                members.discard(key)
                if not members:
                    empty_pack = packed[0]
                    self._pack_members.pop(packed[0], None)
        return forgotten, empty_pack

    def drop(self, names: set[str]) -> int:
        """Forget packs `names` (gone from the bucket) and their blocks: how many were known."""
        dropped = 0
        with self._lock:
            for name in names:
                self._refused.discard(name)
                members = self._pack_members.pop(name, None)
                if members is None:
                    continue
                dropped += 1
                for block in members:
                    if self._packed.get(block, ("",))[0] == name:
                        del self._packed[block]
        return dropped

    def names(self) -> set[str]:
        """Every pack this index holds or refused."""
        with self._lock:
            return set(self._pack_members) | self._refused

    def keys(self) -> set[BlockKey]:
        """Every held or packed key."""
        with self._lock:
            return set(self._pending) | set(self._flying) | set(self._packed)

    def sizes(self) -> tuple[dict[BlockKey, int], dict[BlockKey, int]]:
        """(held key -> object size, packed key -> object size)."""
        with self._lock:
            held = {
                k: len(b)
                for k, (b, _) in itertools.chain(self._flying.items(), self._pending.items())
            }
            packed = {k: length for k, (_, _, length) in self._packed.items()}
        return held, packed

    # -- writing --------------------------------------------------------------------------------

    async def write(self, batch: dict[BlockKey, bytes]) -> str:
        """Write `batch` (in flight, from `due` or `take_all`) as one new pack, named by the
        server's clock; its name. On failure its blocks are pending again, first in line with
        their old times (kept for the next pack rather than lost), and the error raised."""
        head, starts = encode_index((key, len(blob)) for key, blob in batch.items())
        name = pack_name(self.prefix, self.bucket.server_time(), self.writer, next(self._count))
        try:
            await self.bucket.put(name, head + b"".join(batch.values()))
        except BaseException:
            with self._lock:
                back = {k: self._flying.pop(k) for k in batch if k in self._flying}
                for key in back.keys() & self._pending.keys():  # held again meanwhile
                    del back[key]
                self._pending = back | self._pending
            raise
        with self._lock:
            members = self._pack_members.setdefault(name, set())
            for block, blob in batch.items():
                if self._flying.pop(block, None) is None:  # forgotten while in flight
                    continue
                if block in self._pending:  # held again while this pack was in flight
                    continue
                old = self._packed.get(block)
                if old is not None:
                    self._pack_members.get(old[0], set()).discard(block)
                self._packed[block] = (name, starts[block], len(blob))
                members.add(block)
        return name

    # -- loading --------------------------------------------------------------------------------

    async def read_listed(self, listed: list[tuple[str, int]]) -> None:
        """Read the index of each listed (name, size) pack not held or refused yet,
        `PACK_LOADS` at a time. A pack whose index is not what kvtier writes (too large, too
        many entries, not a flat JSON object, entries that are not a key and a range inside
        the pack), or beyond `MAX_PACKED`, is ignored and counted; one bad pack never stops
        the others. A pack the server cannot serve now (`TierUnavailable`, `TierTimeout`)
        fails the whole call: the next listing reads the packs still missing."""
        with self._lock:
            todo = iter(
                [
                    (n, s)
                    for n, s in listed
                    if n not in self._pack_members and n not in self._refused
                ]
            )
        workers = [asyncio.ensure_future(self._load_packs(todo)) for _ in range(PACK_LOADS)]
        try:
            await asyncio.gather(*workers)
        finally:
            for worker in workers:  # after a failure, the others stop too
                worker.cancel()

    async def _load_packs(self, todo: Iterator[tuple[str, int]]) -> None:
        for name, size in todo:
            with self._lock:
                full = self._entries() >= MAX_PACKED
            if full:
                self._refuse_beyond_bound(name)
                continue
            try:
                read = await self._read_index(name, size)
            except (TierUnavailable, TierTimeout):
                raise
            except TierError as e:  # this object, not the server (a planted SSE-C object...)
                log.warning("tier %r: pack %s cannot be read (%s); ignored", self.tier, name, e)
                self._refuse(name)
                continue
            if isinstance(read, _Gone):  # deleted since it was listed
                continue
            if read is None:
                log.warning("tier %r: pack %s has an unreadable index; ignored", self.tier, name)
                self._refuse(name)
                continue
            start, entries = read
            with self._lock:
                if name in self._pack_members:  # loaded meanwhile, by another listing
                    continue
                full = self._entries() + 1 + len(entries) > MAX_PACKED
                if not full:
                    members = self._pack_members.setdefault(name, set())
                    for block, offset, object_size in entries:
                        if block not in self._packed:
                            self._packed[block] = (name, start + offset, object_size)
                            members.add(block)
            if full:
                self._refuse_beyond_bound(name)

    def _entries(self) -> int:
        return len(self._packed) + len(self._pack_members) + len(self._refused)

    def _refuse(self, name: str) -> None:
        """Count pack `name` refused, and remember it (within `MAX_PACKED`) so that no later
        listing reads it again."""
        self.counters["packs_refused"] += 1
        with self._lock:
            if self._entries() < MAX_PACKED:
                self._refused.add(name)

    def _refuse_beyond_bound(self, name: str) -> None:
        self.counters["packs_refused"] += 1
        if not self._bound_logged:
            self._bound_logged = True
            log.warning(
                "tier %r: %d blocks and packs loaded from the bucket's packs (MAX_PACKED);"
                " pack %s and any more are ignored, counted in packs_refused",
                self.tier,
                MAX_PACKED,
                name,
            )

    async def _read_index(
        self, name: str, size: int
    ) -> tuple[int, list[tuple[BlockKey, int, int]]] | None | _Gone:
        """(where the pack's objects start, its entries); None when the index is not one
        kvtier writes, `_GONE` when the pack no longer exists. Reads `PACK_HEAD` bytes, and
        then at most `MAX_PACK_INDEX` for an index that does not fit in them."""
        first = await self.bucket.get_range(name, 0, min(size, PACK_HEAD))
        if first is None:
            return _GONE
        if len(first) < 4:
            return None
        length = int.from_bytes(first[:4], "big")
        if length > MAX_PACK_INDEX or 4 + length > size:
            return None
        head = first[4 : 4 + length]
        if len(head) < length:
            rest = await self.bucket.get_range(name, 4, length)
            if rest is None:
                return _GONE
            head = rest
        if len(head) != length:
            return None
        entries = pack_entries(head, size - 4 - length)
        return None if entries is None else (4 + length, entries)


class _Gone:
    """A pack deleted between its listing and the read of its index (runtime thread: a
    marker value)."""


_GONE = _Gone()
