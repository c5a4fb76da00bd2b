"""The S3 sweeper's knowledge of use (`UseOrder`), on the runtime's event loop (the sweeper's
task; an operator command's `asyncio.run` for `kvtier stats`), its requests in the tier's
thread pool: which objects under the prefix live engines' manifests of use name, and how hot.

A read cannot touch an S3 object, so the bucket alone knows only write order (LastModified).
Every engine writes its manifest of use (`tiering.manager.manifest`: its primary's blocks,
hottest first) as record `manifest.<engine>` of its namespace, the object
`<prefix>kvtier-records/<namespace hex>.manifest.<engine>` (`S3Tier._record_name`), every
`primary.warm_manifest_interval` (60 s by default) and at its shutdown. `named` lists those
objects (at most `MAX_MANIFESTS`, `RECORD_PAGE` a request), reads each (at most
`MAX_MANIFEST_BYTES`), opens it with the envelope of the namespace its name gives (its
checksum, namespace and record name; with `auth.secret`, its seal: an unsealed one is refused)
and decodes it (`decode`: that namespace, that engine). A manifest is live when it was not
written at its writer's shutdown (`ended`) and was written within three of its writer's
`primary.warm_manifest_interval` of now (the manifest says it), or within `LIVE_FOR` where it
does not (an older kvtier's manifest, or a writer that writes at shutdown only), either way
(`tiering.manager.manifest.is_live`: clocks of writers differ; one written far ahead is no live
writer's either).

The keys of the live manifests become ranks (`Named.rank`): a key's rank is its smallest
position in any live manifest (0: some engine's hottest). Each manifest gives at most its
hottest `MAX_NAMED // listed` keys (`listed`: the manifests listed, live or not), so the ranks
never hold more than `MAX_NAMED` keys whatever a manifest claims, and one manifest of millions
of keys takes no more than its share. The tier's own packs (`blocks_per_object` > 1) get the
best rank of the blocks its index knows they hold (`pack_of`); other namespaces' packs are
named by none.

What refuses a manifest or a record of reads (damaged, larger than `MAX_MANIFEST_BYTES`, of
another namespace than its name or another engine, unsealed or sealed with another secret) is
counted (`use_manifests_refused`, `use_reads_refused`) and ignored; either may only reorder what
the sweeper removes, never add to it: the sweeper removes only kvtier's objects under its
prefix, and only while the prefix is over capacity, named or not.

Engines also write what they read from the prefix (`tiers.s3.reads`: each S3 tier with a
`capacity` writes record `reads.<writer id>` every `reads_interval`, the keys it read in the
last three intervals with their times). `named` reads those too (the newest `MAX_READERS` by
LastModified, each at most `MAX_READS_BYTES`, opened and decoded as manifests are; one listed
with the LastModified and size it had at the last reading is not read again), and keeps each
key's newest read across readings (at most `MAX_NAMED` keys, the newest kept): an object's last
use (`Named.used`) is its LastModified or its newest read, whichever is later; a read dated
after the server's now counts as now. A record of reads not written for `READS_EXPIRE` (its
writer gone, or reading nothing for a day) is removed by the sweeper (`drop_expired`, while it
holds the lease), so a fleet's restarts leave no litter.

The ranks are kept as long as the shortest interval of the live writers of manifests and of
records of reads (they change no faster), at least `MIN_REFRESH` seconds and `READ_SHARE` times
what reading them took (the sweeper spends at most a tenth of its time on them), at most
`REFRESH` (a manifest that does not say its interval, or none live), so a sweep every
`sweep_interval` does not read every manifest again, and an order written every few seconds is
followed within seconds.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from tiering.errors import CorruptObject, TierError, TierTimeout, TierUnavailable
from tiering.keys import NAMESPACE_BYTES, BlockKey
from tiering.manager.manifest import (
    LIVE_INTERVALS,
    ManifestRefused,
    decode,
    is_live,
    record_name,
)
from tiering.tier.envelope import Envelope
from tiering.tier.records import RECORD_NAME, RECORD_PAGE, record_key
from tiering.tier.usage import namespace_of
from tiers.s3.client import DELETE_BATCH, Bucket
from tiers.s3.reads import MAX_READS_BYTES, ReadsRefused
from tiers.s3.reads import decode as decode_reads

__all__ = [
    "LIVE_FOR",
    "MAX_MANIFESTS",
    "MAX_MANIFEST_BYTES",
    "MAX_NAMED",
    "MAX_READERS",
    "MIN_REFRESH",
    "READS_EXPIRE",
    "READ_SHARE",
    "RECORDS",
    "REFRESH",
    "Named",
    "UseOrder",
]

log = logging.getLogger(__name__)

RECORDS = "kvtier-records/"
"""Where records lie under the prefix (`S3Tier._record_name`)."""
LIVE_FOR = 180.0
"""Seconds a manifest that does not say its writer's interval (or whose writer writes only at
shutdown) counts as a live engine's: three of `primary.warm_manifest_interval`'s default 60 s."""
REFRESH = 60.0
"""The longest the ranks are kept before the manifests are read again (seconds)."""
MIN_REFRESH = 1.0
"""The shortest the ranks are kept (seconds), however often the writers write."""
READ_SHARE = 10
"""The ranks are kept at least this many times the wall time of their reading."""
MAX_MANIFESTS = 128
"""The most manifests one refresh lists and reads (the first the listing meets)."""
MAX_MANIFEST_BYTES = 8 << 20
"""The largest manifest read (about 226,000 keys of 37 bytes: a 440 GiB primary of 2 MiB
blocks); a larger one is refused."""
MAX_NAMED = 500_000
"""The most keys the ranks hold (~65 MB), shared among the manifests listed."""
MAX_LISTED_PAGES = 64
"""The most pages of records one reading lists (64,000 records)."""
MAX_READERS = 128
"""The most records of reads one reading reads (the newest written)."""
READS_EXPIRE = 86_400.0
"""Seconds after its last write a record of reads is removed by the sweeper."""
READS_PREFIX = "reads."


Listed = tuple[bytes, str, str, tuple[float, int]]
"""A record of reads listed: namespace, record name, object name, (LastModified, size)."""


def _name_key(namespace: bytes, key: BlockKey) -> bytes:
    return namespace + key


@dataclass(frozen=True, slots=True)
class Named:
    """What the live manifests name at one time (any thread: a value)."""

    ranks: Mapping[bytes, int] = field(default_factory=dict)
    """Namespace + key -> its rank (0: hottest)."""
    packs: Mapping[str, int] = field(default_factory=dict)
    """A pack's object name -> the best rank of its blocks."""
    live: int = 0
    """Live manifests followed."""
    stale: int = 0
    """Manifests read that are not live (ended, or written too long ago: `is_live`)."""
    refused: int = 0
    clipped: int = 0
    """Keys beyond a manifest's share, left out."""
    interval: float | None = None
    """The shortest interval of the live manifests' and the records of reads' writers (None:
    none says one)."""
    reads: Mapping[bytes, float] = field(default_factory=dict)
    """Namespace + key -> its newest read (Unix seconds, the server's clock)."""
    pack_reads: Mapping[str, float] = field(default_factory=dict)
    """A pack's object name -> the newest read of its blocks."""
    readers: int = 0
    """Records of reads followed."""
    refused_reads: int = 0

    @property
    def by_use(self) -> bool:
        return self.live > 0 or bool(self.reads)

    def _known(self, prefix: str, name: str) -> bytes | None:
        relative = name[len(prefix) :]
        try:
            return bytes.fromhex(relative[:32]) + bytes.fromhex(relative[36:])
        except ValueError:
            return None

    def rank(self, prefix: str, name: str) -> int | None:
        """The rank of object `name` (a sweepable name under `prefix`), None: named by none."""
        if "/packs/" in name:
            return self.packs.get(name)
        known = self._known(prefix, name)
        return None if known is None else self.ranks.get(known)

    def used(self, prefix: str, name: str, modified: float) -> float:
        """The last use of object `name` written at `modified`: that, or its newest read."""
        if "/packs/" in name:
            read = self.pack_reads.get(name)
        else:
            known = self._known(prefix, name) if self.reads else None
            read = None if known is None else self.reads.get(known)
        return modified if read is None or read < modified else read

    def line(self) -> str:
        """The order a sweep follows, as `kvtier stats` shows it."""
        reads = f"{self.readers} records of reads, {len(self.reads):,} keys read"
        if self.by_use:
            named = f"{self.live} live manifests, {len(self.ranks):,} keys named"
            return f"by use: {named}" + (f"; {reads}" if self.reads else "")
        why = f"{self.stale} stale or ended" if self.stale else "none"
        return f"write order: no live manifest ({why}), no read recorded ({reads})"

    def fields(self) -> dict[str, object]:
        return {
            "order": "use" if self.by_use else "write",
            "live_manifests": self.live,
            "named_keys": len(self.ranks),
            "stale_manifests": self.stale,
            "refused_manifests": self.refused,
            "read_records": self.readers,
            "read_keys": len(self.reads),
            "refused_read_records": self.refused_reads,
        }


class UseOrder:
    """The live manifests under one S3 tier's prefix, read at most every `REFRESH` (runtime's
    event loop)."""

    def __init__(
        self,
        bucket: Bucket,
        prefix: str,
        *,
        tier: str,
        envelope: Callable[[bytes], Envelope],
        room: int,
        counters: Counter[str],
        pack_of: Callable[[bytes, BlockKey], str | None] = lambda namespace, key: None,
    ) -> None:
        """`envelope`: the envelope that opens a record of a namespace (the tier's secret);
        `room`: the envelope's header bytes beyond a record's data; `pack_of`: the pack the
        tier's index knows a block of a namespace to lie in, or None."""
        self.bucket = bucket
        self.base = f"{prefix}{RECORDS}"
        self.tier = tier
        self.envelope = envelope
        self.room = room
        self.counters = counters
        self.pack_of = pack_of
        self._named: Named | None = None
        self._read_at = 0.0
        self._reads: dict[bytes, float] = {}
        """Every key's newest read the records have given (module docstring)."""
        self._expired: list[str] = []
        self._seen: dict[str, tuple[tuple[float, int], float, float]] = {}
        """A record of reads' name -> (its LastModified and size, its writer's interval
        (negative: refused), its time) at the last reading."""
        self.keep = REFRESH
        """Seconds the last reading is kept (module docstring)."""

    @property
    def cached(self) -> Named | None:
        """What the manifests named when read less than `keep` seconds ago, else None."""
        if self._named is None or time.monotonic() - self._read_at >= self.keep:
            return None
        return self._named

    async def named(self, now: float | None = None) -> Named:
        """What the live manifests name, read again when older than `keep` seconds."""
        named = self.cached
        if named is None:
            began = time.monotonic()
            named = self._named = await self.read(now)
            self._read_at = time.monotonic()
            took = READ_SHARE * (self._read_at - began)
            self.keep = min(REFRESH, max(MIN_REFRESH, took, named.interval or REFRESH))
        return named

    async def read(self, now: float | None = None) -> Named:
        """Read every listed manifest now (module docstring)."""
        now = time.time() if now is None else now
        listed, readers = await self._list()
        share = MAX_NAMED // max(1, len(listed))
        ranks: dict[bytes, int] = {}
        packs: dict[str, int] = {}
        live = stale = refused = clipped = 0
        interval: float | None = None
        for namespace, record, name in listed:
            engine = record[len(record_name("")) :]
            try:
                data = await self._fetch(namespace, record, name, MAX_MANIFEST_BYTES)
                if data is None:
                    continue  # removed since the listing
                manifest = decode(data, namespace, engine)
            except (TierUnavailable, TierTimeout):
                raise
            except (CorruptObject, ManifestRefused, TierError) as e:
                refused += 1
                self._ignored("manifest", name, e, first=refused == 1)
                continue
            if not is_live(manifest, now, LIVE_FOR):
                stale += 1
                continue
            live += 1
            if manifest.interval:
                interval = min(interval or manifest.interval, manifest.interval)
            clipped += max(0, len(manifest.keys) - share)
            for rank, key in enumerate(manifest.keys[:share]):
                known = _name_key(namespace, key)
                if rank < ranks.get(known, rank + 1):
                    ranks[known] = rank
                pack = self.pack_of(namespace, key)
                if pack is not None and rank < packs.get(pack, rank + 1):
                    packs[pack] = rank
        if clipped:
            self.counters["use_keys_clipped"] += clipped
        followed, refused_reads, every = await self._read_reads(readers)
        if every is not None:
            interval = min(interval or every, every)
        pack_reads: dict[str, float] = {}
        if followed:
            for known, at in self._reads.items():
                pack = self.pack_of(known[:NAMESPACE_BYTES], BlockKey(known[NAMESPACE_BYTES:]))
                if pack is not None and at > pack_reads.get(pack, at - 1):
                    pack_reads[pack] = at
        return Named(
            ranks,
            packs,
            live,
            stale,
            refused,
            clipped,
            interval,
            dict(self._reads),
            pack_reads,
            followed,
            refused_reads,
        )

    async def _read_reads(self, listed: list[Listed]) -> tuple[int, int, float | None]:
        """Merge the records of reads `listed` into `_reads`: (followed, refused, the shortest
        interval of the writers that wrote within three of theirs). A record listed with the
        LastModified and size it had at the last reading is not read again (merged then)."""
        server_now = self.bucket.server_time()
        followed = refused = 0
        every: float | None = None
        seen: dict[str, tuple[tuple[float, int], float, float]] = {}
        for namespace, record, name, version in listed:
            before = self._seen.get(name)
            if before is not None and before[0] == version:
                seen[name] = before
                _, interval, at = before
                if interval < 0:
                    refused += 1
                    continue
                followed += 1
                if interval and server_now - at <= LIVE_INTERVALS * interval:
                    every = min(every or interval, interval)
                continue
            try:
                data = await self._fetch(namespace, record, name, MAX_READS_BYTES)
                if data is None:
                    continue
                found = decode_reads(data, namespace)
            except (TierUnavailable, TierTimeout):
                raise
            except (CorruptObject, ReadsRefused, TierError) as e:
                refused += 1
                seen[name] = (version, -1.0, 0.0)
                self._ignored("record of reads", name, e, first=refused == 1)
                continue
            followed += 1
            at = min(found.written_at, server_now)
            seen[name] = (version, found.interval, at)
            if found.interval and server_now - at <= LIVE_INTERVALS * found.interval:
                every = min(every or found.interval, found.interval)
            for key, age in zip(found.keys, found.ages, strict=True):
                known = _name_key(namespace, key)
                when = at - age
                if when > self._reads.get(known, when - 1):
                    self._reads[known] = when
        if len(self._reads) > MAX_NAMED:
            newest = heapq.nlargest(MAX_NAMED, self._reads.items(), key=lambda item: item[1])
            self._reads = dict(newest)
        self._seen = seen
        return followed, refused, every

    async def _fetch(self, namespace: bytes, record: str, name: str, limit: int) -> bytes | None:
        """The data of record object `name` (at most `limit` bytes), opened by the envelope of
        its namespace; None when it is gone since the listing. `CorruptObject` when refused."""
        blob = await self.bucket.get(name, limit + self.room)
        if blob is None:
            return None
        return bytes(self.envelope(namespace).open(record_key(record), blob)[1])

    def _ignored(self, what: str, name: str, e: Exception, *, first: bool) -> None:
        """Count (`use_manifests_refused`, `use_reads_refused`) and log a record refused: the
        first of a reading as a warning."""
        self.counters["use_manifests_refused" if what == "manifest" else "use_reads_refused"] += 1
        level = logging.WARNING if first else logging.DEBUG
        log.log(level, "tier %r: the sweeper ignores the %s %s (%s)", self.tier, what, name, e)

    async def drop_expired(self) -> int:
        """Remove the records of reads the last reading found unwritten for `READS_EXPIRE`
        (the sweeper, holding the lease): how many."""
        names, self._expired = self._expired, []
        if not names:
            return 0
        removed = len(names) - await self.bucket.delete_names(names)
        self.counters["reads_records_expired"] += removed
        return removed

    async def _list(self) -> tuple[list[tuple[bytes, str, str]], list[Listed]]:
        """(namespace, record name, object name) of the manifests listed, at most
        `MAX_MANIFESTS`, and of the newest `MAX_READERS` records of reads; names that are
        neither's are left out. Records of reads unwritten for `READS_EXPIRE` are set aside
        for `drop_expired`."""
        found: list[tuple[bytes, str, str]] = []
        reads: list[tuple[float, bytes, str, str, int]] = []
        expired: list[str] = []
        token: str | None = None
        now = self.bucket.server_time()
        pages = 0
        while pages < MAX_LISTED_PAGES:
            page, token = await self.bucket.list_page(self.base, token, RECORD_PAGE)
            pages += 1
            for name, size, modified in page:
                text, dot, record = name[len(self.base) :].partition(".")
                namespace = namespace_of(text)
                if namespace is None or not dot or not RECORD_NAME.match(record):
                    continue
                if record.startswith(READS_PREFIX):
                    if now - modified > READS_EXPIRE:
                        expired.append(name)
                    else:
                        reads.append((modified, namespace, record, name, size))
                elif record.startswith(record_name("")) and len(found) < MAX_MANIFESTS:
                    found.append((namespace, record, name))
            if token is None:
                break
        self._expired = expired[:DELETE_BATCH]
        newest = heapq.nlargest(MAX_READERS, reads, key=lambda item: item[0])
        return found, [(ns, record, name, (at, size)) for at, ns, record, name, size in newest]
