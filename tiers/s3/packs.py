"""Packs: several blocks in one S3 object, and the S3 tier's index of them.

A pack (`<prefix><namespace hex>/packs/<id>`) is a 4-byte big-endian index length, a JSON index
of `key hex -> [offset, length]` (offsets from the end of the index), then the objects back to
back. A hit reads only its byte range (ranged GET). The index of packs is rebuilt from the
packs' own indexes, so packs survive restarts: the first call starts one background load of
every pack's index, which no caller's deadline cancels (a call waits for it under its own
deadline; a failed load is started again by the next call), and `refresh` reads the packs
written since. Blocks not yet packed are held in memory (pending) and written out at close.
Deleting a packed block forgets it in this process; the pack object itself goes when all its
blocks are deleted.

Anyone who can write to the bucket can plant a pack, so what a pack's index costs is bounded:
`MAX_PACK_INDEX` bytes, `MAX_PACK_ENTRIES` entries, and `MAX_PACKED` blocks and packs loaded
from the bucket in all. A pack beyond a bound, or whose index is not what kvtier writes, is
ignored and counted (`packs_refused`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import uuid
from collections import Counter
from collections.abc import Iterator

from tiering.errors import KeyFormatError, TierError, TierTimeout, TierUnavailable
from tiering.keys import BlockKey, key_from_hex
from tiers.s3.client import Bucket

__all__ = [
    "MAX_PACKED",
    "MAX_PACK_ENTRIES",
    "MAX_PACK_INDEX",
    "PACK_HEAD",
    "PACK_LOADS",
    "PACK_PAGE",
    "Packs",
    "Place",
]

log = logging.getLogger(__name__)

MAX_PACK_ENTRIES = 4096
"""Entries a pack's index may hold: the most `blocks_per_object` allows."""
MAX_PACK_INDEX = 1 << 20
"""Bytes a pack's index may claim: an entry kvtier writes takes at most ~170 bytes (a key of
68 bytes in hex, two offsets), so `MAX_PACK_ENTRIES` of them fit. A larger claim is refused
unread."""
MAX_PACKED = 2_000_000
"""Blocks and packs the tier loads from the bucket's packs, in all (one entry costs ~300 bytes
of memory): the packs beyond are refused. Packs this process writes count towards it but are
never refused."""
PACK_HEAD = 16 << 10
"""Bytes read from the start of a pack to find its index: one GET for any pack of up to ~100
blocks, a second for a larger index."""
PACK_LOADS = 8
"""Pack indexes read at once (through the tier's thread pool) while loading."""
PACK_PAGE = 1000
"""Pack names listed at a time while loading (S3's largest page): the listing of a bucket full
of planted packs is never held whole."""

Place = tuple[str, int, int]
"""Where a packed block's object lies: (pack name, offset, length)."""


class Packs:
    """The S3 tier's packs: which pack holds each block, the blocks waiting for a pack, the
    live blocks of each pack. Runs on the runtime's event loop; the maps are guarded by a
    lock, so any thread may read them."""

    def __init__(
        self, bucket: Bucket, base: str, tier: str, counters: Counter[str], blocks_per_object: int
    ) -> None:
        """`base`: the namespace's prefix in the bucket; `tier`: the tier's name (messages);
        `counters`: the tier's counters (`packs_refused`)."""
        self.bucket = bucket
        self.prefix = f"{base}packs/"
        self.tier = tier
        self.counters = counters
        self.blocks_per_object = blocks_per_object
        self._lock = threading.Lock()
        self._packed: dict[BlockKey, Place] = {}
        self._pending: dict[BlockKey, bytes] = {}
        self._pack_members: dict[str, set[BlockKey]] = {}
        self.loaded = blocks_per_object == 1
        """Whether every pack in the bucket has been loaded (from the start without packing)."""
        self.loading: asyncio.Task[None] | None = None
        """The background load of the packs' indexes, while one runs or after it failed."""
        self._bound_logged = False

    # -- the maps -------------------------------------------------------------------------------

    def where(self, key: BlockKey) -> tuple[bytes | None, Place | None]:
        """The pending object of `key`, and where its packed one lies (either may be None)."""
        with self._lock:
            return self._pending.get(key), self._packed.get(key)

    def known(self, keys: list[BlockKey]) -> list[bool]:
        """Whether each key is pending or packed."""
        with self._lock:
            return [k in self._pending or k in self._packed for k in keys]

    def hold(self, key: BlockKey, blob: bytes) -> dict[BlockKey, bytes] | None:
        """Keep `blob` as the pending object of `key`; the batch to write as a pack once
        `blocks_per_object` are pending (they are no longer pending then)."""
        with self._lock:
            self._pending[key] = blob
            if len(self._pending) < self.blocks_per_object:
                return None
            batch, self._pending = self._pending, {}
            return batch

    def take_pending(self) -> dict[BlockKey, bytes]:
        """Every pending object (none is pending after)."""
        with self._lock:
            batch, self._pending = self._pending, {}
            return batch

    def forget(self, key: BlockKey) -> tuple[bool, str | None]:
        """Forget `key`'s pending and packed objects: whether there was one, and the pack that
        now holds no live block (to delete), if any."""
        forgotten = False
        empty_pack = None
        with self._lock:
            if self._pending.pop(key, None) is not None:
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

    def keys(self) -> set[BlockKey]:
        """Every pending or packed key."""
        with self._lock:
            return set(self._pending) | set(self._packed)

    def sizes(self) -> tuple[dict[BlockKey, int], dict[BlockKey, int]]:
        """(pending key -> object size, packed key -> object size)."""
        with self._lock:
            pending = {k: len(b) for k, b in self._pending.items()}
            packed = {k: length for k, (_, _, length) in self._packed.items()}
        return pending, packed

    # -- writing --------------------------------------------------------------------------------

    async def write(self, batch: dict[BlockKey, bytes]) -> None:
        """Write `batch` as one new pack; on failure its blocks are pending again (kept for
        the next pack rather than lost) and the error raised."""
        index: dict[str, list[int]] = {}
        at = 0
        for key, blob in batch.items():
            index[key.hex()] = [at, len(blob)]
            at += len(blob)
        head = json.dumps(index, separators=(",", ":")).encode()
        prefix = len(head).to_bytes(4, "big") + head
        name = f"{self.prefix}{uuid.uuid4().hex}"
        try:
            await self.bucket.put(name, prefix + b"".join(batch.values()))
        except TierError:
            with self._lock:
                for key, blob in batch.items():
                    self._pending.setdefault(key, blob)
            raise
        with self._lock:
            members = self._pack_members.setdefault(name, set())
            for text, (offset, length) in index.items():
                block = key_from_hex(text)
                if block in self._pending:  # rewritten while this pack was in flight
                    continue
                old = self._packed.get(block)
                if old is not None:
                    self._pack_members.get(old[0], set()).discard(block)
                self._packed[block] = (name, len(prefix) + offset, length)
                members.add(block)

    # -- loading --------------------------------------------------------------------------------

    async def load(self) -> None:
        """Wait, under the caller's deadline, for the one background load of the packs'
        indexes, starting it when none runs (the first call, or the last load failed)."""
        if self.loaded:
            return
        loading = self.loading
        if (
            loading is None
            or loading.done()  # it failed: start it again
            or loading.get_loop() is not asyncio.get_running_loop()  # left on a closed loop
        ):
            loading = self.loading = asyncio.ensure_future(self._load_all())
            loading.add_done_callback(_retrieve)
        try:
            await asyncio.shield(loading)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if loading.cancelled() and task is not None and not task.cancelling():
                # `stop_loading` stopped the load: this caller was not cancelled, so it must
                # not see a cancellation
                raise TierUnavailable(f"tier {self.tier!r}: closed while loading packs") from None
            raise

    async def stop_loading(self) -> None:
        """Cancel the background load, if one runs (the tier is closing)."""
        loading, self.loading = self.loading, None
        if loading is not None and not loading.done():
            loading.cancel()  # its pool calls already queued end at the pool's shutdown
            if loading.get_loop() is asyncio.get_running_loop():
                await asyncio.wait([loading])

    async def _load_all(self) -> None:
        try:
            await self.refresh()
        except TierError as e:
            log.warning(
                "tier %r: loading pack indexes failed (%s); retried at the next call", self.tier, e
            )
            raise

    async def refresh(self) -> None:
        """Read the index of every pack in the bucket not loaded yet (packs written by other
        processes, or before a restart), `PACK_LOADS` at a time, a page of the listing at a
        time. A pack whose index is not what kvtier writes (too large, too many entries, not a
        flat JSON object, entries that are not a key and a range inside the pack), or beyond
        `MAX_PACKED`, is ignored and counted (at each refresh that meets it); one bad pack
        never stops the others. A pack the server cannot serve now (`TierUnavailable`,
        `TierTimeout`) fails the whole refresh: the next one reads the packs still missing."""
        token: str | None = None
        while True:
            page, token = await self.bucket.list_page(self.prefix, token, PACK_PAGE)
            with self._lock:
                todo = iter([(n, size) for n, size in page if n not in self._pack_members])
            workers = [asyncio.ensure_future(self._load_packs(todo)) for _ in range(PACK_LOADS)]
            try:
                await asyncio.gather(*workers)
            finally:
                for worker in workers:  # after a failure, the others stop too
                    worker.cancel()
            if token is None:
                self.loaded = True
                return

    async def _load_packs(self, todo: Iterator[tuple[str, int]]) -> None:
        for name, size in todo:
            with self._lock:
                full = len(self._packed) + len(self._pack_members) >= MAX_PACKED
            if full:
                self._refuse_beyond_bound(name)
                continue
            try:
                read = await self._read_index(name, size)
            except (TierUnavailable, TierTimeout):
                raise
            except TierError as e:  # this object, not the server (a planted SSE-C object...)
                log.warning("tier %r: pack %s cannot be read (%s); ignored", self.tier, name, e)
                self.counters["packs_refused"] += 1
                continue
            if isinstance(read, _Gone):  # deleted since it was listed
                continue
            if read is None:
                self.counters["packs_refused"] += 1
                log.warning("tier %r: pack %s has an unreadable index; ignored", self.tier, name)
                continue
            start, entries = read
            with self._lock:
                if name in self._pack_members:  # loaded meanwhile, by another refresh
                    continue
                full = len(self._packed) + len(self._pack_members) + 1 + len(entries) > MAX_PACKED
                if not full:
                    members = self._pack_members.setdefault(name, set())
                    for block, offset, object_size in entries:
                        if block not in self._packed:
                            self._packed[block] = (name, start + offset, object_size)
                            members.add(block)
            if full:
                self._refuse_beyond_bound(name)

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
        entries = _pack_entries(head, size - 4 - length)
        return None if entries is None else (4 + length, entries)


class _Gone:
    """A pack deleted between its listing and the read of its index (runtime thread: a
    marker value)."""


_GONE = _Gone()


def _retrieve(task: asyncio.Task[None]) -> None:
    """Mark a load's failure as seen: the callers that waited got it, and nobody else needs
    asyncio's "exception was never retrieved" at garbage collection."""
    if not task.cancelled():
        task.exception()


def _pack_entries(head: bytes, room: int) -> list[tuple[BlockKey, int, int]] | None:
    """A pack index's entries (key, offset, length), each range inside the `room` bytes after
    the index; None when it is not an index kvtier writes: a flat JSON object of at most
    `MAX_PACK_ENTRIES` entries, one list each (counted before parsing, so a wide index costs
    no parse; a deep one makes the parser raise RecursionError)."""
    if head.count(b"[") > MAX_PACK_ENTRIES:
        return None
    try:
        index = json.loads(head)
    except (ValueError, RecursionError):
        return None
    if not isinstance(index, dict) or not index:
        return None
    entries = []
    for text, where in index.items():
        if not (
            isinstance(where, list)
            and len(where) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in where)
            and where[0] + where[1] <= room
        ):
            return None
        try:
            entries.append((key_from_hex(text), where[0], where[1]))
        except KeyFormatError:
            return None
    return entries
