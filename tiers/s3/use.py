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

What refuses a manifest (damaged, larger than `MAX_MANIFEST_BYTES`, of another namespace than
its name or another engine, unsealed or sealed with another secret) is counted
(`use_manifests_refused`) and ignored; a manifest may only reorder what the sweeper removes,
never add to it: the sweeper removes only kvtier's objects under its prefix, and only while
the prefix is over capacity, named or not.

The ranks are kept as long as the live manifests' shortest writer's interval (they change no
faster), at least `MIN_REFRESH` seconds and `READ_SHARE` times what reading them took (the
sweeper spends at most a tenth of its time on them), at most `REFRESH` (a manifest that does
not say its interval, or none live), so a sweep every `sweep_interval` does not read every
manifest again, and an order written every few seconds is followed within seconds.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from tiering.errors import CorruptObject, TierError, TierTimeout, TierUnavailable
from tiering.keys import BlockKey
from tiering.manager.manifest import ManifestRefused, decode, is_live, record_name
from tiering.tier.envelope import Envelope
from tiering.tier.records import RECORD_NAME, RECORD_PAGE, record_key
from tiering.tier.usage import namespace_of
from tiers.s3.client import Bucket

__all__ = [
    "LIVE_FOR",
    "MAX_MANIFESTS",
    "MAX_MANIFEST_BYTES",
    "MAX_NAMED",
    "MIN_REFRESH",
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
    """The shortest interval of the live manifests' writers (None: none says one)."""

    @property
    def by_use(self) -> bool:
        return self.live > 0

    def rank(self, prefix: str, name: str) -> int | None:
        """The rank of object `name` (a sweepable name under `prefix`), None: named by none."""
        if "/packs/" in name:
            return self.packs.get(name)
        relative = name[len(prefix) :]
        try:
            return self.ranks.get(bytes.fromhex(relative[:32]) + bytes.fromhex(relative[36:]))
        except ValueError:
            return None

    def line(self) -> str:
        """The order a sweep follows, as `kvtier stats` shows it."""
        if self.by_use:
            return f"by use: {self.live} live manifests, {len(self.ranks):,} keys named"
        why = f"{self.stale} stale or ended" if self.stale else "none"
        return f"write order: no live manifest ({why})"

    def fields(self) -> dict[str, object]:
        return {
            "order": "use" if self.by_use else "write",
            "live_manifests": self.live,
            "named_keys": len(self.ranks),
            "stale_manifests": self.stale,
            "refused_manifests": self.refused,
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
        listed = await self._list()
        share = MAX_NAMED // max(1, len(listed))
        ranks: dict[bytes, int] = {}
        packs: dict[str, int] = {}
        live = stale = refused = clipped = 0
        interval: float | None = None
        for namespace, record, name in listed:
            engine = record[len(record_name("")) :]
            try:
                blob = await self.bucket.get(name, MAX_MANIFEST_BYTES + self.room)
                if blob is None:
                    continue  # removed since the listing
                data = self.envelope(namespace).open(record_key(record), blob)[1]
                manifest = decode(bytes(data), namespace, engine)
            except (TierUnavailable, TierTimeout):
                raise
            except (CorruptObject, ManifestRefused, TierError) as e:
                refused += 1
                self.counters["use_manifests_refused"] += 1
                log.log(
                    logging.WARNING if refused == 1 else logging.DEBUG,
                    "tier %r: the sweeper ignores the manifest %s (%s)",
                    self.tier,
                    name,
                    e,
                )
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
        return Named(ranks, packs, live, stale, refused, clipped, interval)

    async def _list(self) -> list[tuple[bytes, str, str]]:
        """(namespace, record name, object name) of the manifests listed, at most
        `MAX_MANIFESTS`; names that are no manifest's are left out."""
        found: list[tuple[bytes, str, str]] = []
        token: str | None = None
        while len(found) < MAX_MANIFESTS:
            page, token = await self.bucket.list_page(self.base, token, RECORD_PAGE)
            for name, _, _ in page:
                text, dot, record = name[len(self.base) :].partition(".")
                namespace = namespace_of(text)
                if (
                    namespace is None
                    or not dot
                    or not record.startswith(record_name(""))
                    or not RECORD_NAME.match(record)
                ):
                    continue
                found.append((namespace, record, name))
            if token is None:
                break
        return found[:MAX_MANIFESTS]
