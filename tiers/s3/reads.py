"""What an engine read from an S3 tier, published for the prefix's sweeper: the record of reads
(`ReadLog`, on the runtime's event loop; `encode`/`decode`, `Reads`: values, any thread).

A read cannot touch an S3 object, so the bucket knows only write order (LastModified). An S3
tier with a `capacity` notes each block `get` served (a verified hit, `Tier._served`) and each
block a write found there already (`write_once`: the fleet wanted it again), the newest
`MAX_READS` with the time of each. Every `reads_interval` seconds (0: never) it writes those of
the last `WINDOW` intervals, newest first, as record `reads.<writer id>` of its namespace (the
object `<prefix>kvtier-records/<namespace hex>.reads.<writer hex>`, sealed by the tier's
envelope like every record), when it noted anything since its last write, and once more at
close. The sweeper (`tiers.s3.use`) takes an object's last use as its LastModified or the
newest read any record gives it, whichever is later: least recently used first, as a `files`
directory's mtime and Redis's LRU give.

Bounded: a record names at most `MAX_READS` keys (about 2.7 MB of sha256 keys), a write waits at
least `DUTY` times the last one's wall time, and a write that fails is counted
(`reads_record_failures`), logged once and tried again at the next interval; nothing is ever
raised into the data path, which only notes.

Times are the bucket server's clock (`Bucket.server_time`, what LastModified is on), as its
writer knew it. Body, integers big-endian: `MAGIC` (8 bytes), version (u16), namespace (16),
written at (f64, Unix seconds), the writer's interval (f64 seconds), count (u32), then per
key: its length (u8) and bytes, and its age at the write (f32 seconds, at least 0). A body that
is truncated, has bytes after its keys, names another namespace or more than `MAX_READS` keys,
or gives an age or time that is not a finite number, is refused whole (`ReadsRefused`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import struct
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Final

from tiering.errors import TierError
from tiering.keys import GROUP_BYTES, MAX_HASH_BYTES, BlockKey
from tiers.s3.background import Background

__all__ = [
    "DUTY",
    "MAGIC",
    "MAX_READS",
    "MAX_READS_BYTES",
    "WINDOW",
    "ReadLog",
    "Reads",
    "ReadsRefused",
    "decode",
    "encode",
    "reads_name",
]

log = logging.getLogger(__name__)

MAGIC: Final = b"KVTREAD\x00"
VERSION: Final = 1
MAX_READS: Final = 65_536
"""The most keys one record names (the newest reads)."""
WINDOW: Final = 3
"""A record names the reads of this many of its writer's intervals: a sweeper that reads the
records at least once an interval misses none, and one late write loses none."""
DUTY: Final = 100
"""A write waits at least this many times the last one's wall time (1 % of the loop)."""
_HEAD = struct.Struct(">8sH16sddI")  # magic, version, namespace, written at, interval, count
_AGE = struct.Struct(">f")
_KEY_BYTES = range(GROUP_BYTES + 1, MAX_HASH_BYTES + GROUP_BYTES + 1)
MAX_READS_BYTES: Final = _HEAD.size + MAX_READS * (1 + _KEY_BYTES[-1] + _AGE.size)
"""The largest body a record of `MAX_READS` keys can have."""


def reads_name(writer: bytes) -> str:
    """The record a writer's reads are stored as."""
    return f"reads.{writer.hex()}"


class ReadsRefused(ValueError):
    """A record of reads that may not be followed (one word of reason first)."""


@dataclass(frozen=True, slots=True)
class Reads:
    """One writer's record of reads (any thread: a value)."""

    namespace: bytes
    written_at: float
    interval: float
    keys: Sequence[BlockKey]
    """Newest read first."""
    ages: Sequence[float]
    """Seconds before `written_at` each key was read."""


def encode(reads: Reads) -> bytes:
    """The record's body (module docstring)."""
    head = _HEAD.pack(
        MAGIC, VERSION, reads.namespace, reads.written_at, reads.interval, len(reads.keys)
    )
    parts = [head]
    for key, age in zip(reads.keys, reads.ages, strict=True):
        parts += [bytes([len(key)]), key, _AGE.pack(age)]
    return b"".join(parts)


def decode(data: bytes, namespace: bytes) -> Reads:
    """The record `data` holds, when it is whole and of `namespace`; else `ReadsRefused`."""
    if len(data) < _HEAD.size or not data.startswith(MAGIC):
        raise ReadsRefused("magic: not a kvtier record of reads")
    _, version, ns, written_at, interval, count = _HEAD.unpack_from(data)
    if version != VERSION:
        raise ReadsRefused(f"version: format {version}, this kvtier reads {VERSION}")
    if ns != namespace:
        raise ReadsRefused(f"namespace: of {ns.hex()}, not {namespace.hex()}")
    if not (math.isfinite(written_at) and math.isfinite(interval) and interval >= 0):
        raise ReadsRefused(f"corrupt: written at {written_at}, interval {interval}")
    if count > MAX_READS:
        raise ReadsRefused(f"size: {count:,} keys, at most {MAX_READS:,}")
    keys: list[BlockKey] = []
    ages: list[float] = []
    view, at = memoryview(data), _HEAD.size
    for _ in range(count):
        length = data[at] if at < len(data) else 0
        if length not in _KEY_BYTES or at + 1 + length + _AGE.size > len(data):
            raise ReadsRefused(f"truncated: key {len(keys)} at byte {at}")
        keys.append(BlockKey(bytes(view[at + 1 : at + 1 + length])))
        (age,) = _AGE.unpack_from(data, at + 1 + length)
        if not (math.isfinite(age) and age >= 0):
            raise ReadsRefused(f"corrupt: an age of {age} s")
        ages.append(age)
        at += 1 + length + _AGE.size
    if at != len(data):
        raise ReadsRefused(f"corrupt: {len(data) - at} bytes after its keys")
    return Reads(ns, written_at, interval, keys, ages)


class ReadLog:
    """The blocks one S3 tier read (or found when writing), written as its record of reads
    every `interval` (runtime's event loop)."""

    def __init__(
        self,
        *,
        tier: str,
        namespace: bytes,
        name: str,
        interval: float,
        write: Callable[[str, bytes], Awaitable[object]],
        counters: Counter[str],
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`name`: the record's name (`reads_name`); `interval`: 0 notes nothing; `write`:
        writes a record (`Tier.write_record`); `clock`: Unix seconds as the bucket's server
        tells them (what its LastModified is on)."""
        self.tier = tier
        self.namespace = namespace
        self.name = name
        self.interval = interval
        self.write = write
        self.counters = counters
        self.clock = clock
        self._read: OrderedDict[BlockKey, float] = OrderedDict()
        self._changed = False
        self._failing = False
        self._task = Background(f"tier {tier!r}: record of reads", self._run)

    def note(self, key: BlockKey) -> None:
        """Block `key` was read (or found by a write) now."""
        if not self.interval:
            return
        self._read[key] = self.clock()
        self._read.move_to_end(key)
        if len(self._read) > MAX_READS:
            self._read.popitem(last=False)
        self._changed = True
        self._task.ensure()

    def record(self, now: float | None = None) -> Reads:
        """The reads of the last `WINDOW` intervals, newest first."""
        now = self.clock() if now is None else now
        since = now - WINDOW * self.interval
        keys: list[BlockKey] = []
        ages: list[float] = []
        for key in reversed(self._read):
            at = self._read[key]
            if at < since:
                break
            keys.append(key)
            ages.append(max(0.0, now - at))
        return Reads(self.namespace, now, self.interval, keys, ages)

    async def publish(self) -> None:
        """Write the record when anything was noted since the last write (failures counted,
        logged once until one succeeds)."""
        if not self._changed:
            return
        self._changed = False
        try:
            await self.write(self.name, encode(self.record()))
        except TierError as e:
            self._changed = True
            self.counters["reads_record_failures"] += 1
            if not self._failing:
                self._failing = True
                log.warning("tier %r: writing its record of reads failed (%s)", self.tier, e)
            return
        self._failing = False
        self.counters["reads_records_written"] += 1

    async def close(self) -> None:
        """End the task, then write what is left."""
        await self._task.stop()
        await self.publish()

    async def _run(self) -> None:
        wait = self.interval
        while True:
            await asyncio.sleep(wait)
            began = time.monotonic()
            await self.publish()
            wait = max(self.interval, DUTY * (time.monotonic() - began))
