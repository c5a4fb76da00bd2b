"""The S3 tier's sweeper (`Sweeper`): keeps a bucket prefix within `capacity`, oldest objects
first; one background task on the runtime's event loop, sweeping only while this engine holds
the prefix's lease (`tiers.s3.lease`), so one engine of those sharing the prefix sweeps it.

A pass, every `sweep_interval`, lists every object under the prefix and counts what kvtier wrote
there, in every namespace (block objects `<32 hex>/<ab>/<key hex>` and packs `<32
hex>/packs/<name>`; nothing else is counted or removed): when that is over `capacity`, it
deletes objects until it is not, in the order of use as far as engines tell it (`tiers.s3.use`):
first the objects no live engine's manifest of use names, least recently used (LastModified, the
server's clock, or the newest read engines' records of reads give; ties by name) first, then the
named ones, least hot (the highest rank) first, least recently used first among equals. With no
live manifest and no record of reads that is write order, the oldest first, as the bucket alone
can tell it. A pack is counted and removed whole. Namespaces no engine writes any more are named
by none and the oldest, and go first. A pass that finds the prefix over capacity without the
manifests at hand reads them (kept as long as `tiers.s3.use` says) and sweeps again at once. A
pass keeps only the `SWEEP_BATCH` first objects to remove in memory; when deleting them all is
not enough, the next pass follows at once. It renews the lease as due between the pages of its
listing, and checks that it still holds it before each delete request.

The bound: the prefix holds at most `capacity` plus what was written since the listing of the
sweeper's last pass began (at most `sweep_interval` and a pass ago), and while a dead holder's
lease lapses (`LEASE_TTL` and half of it to notice) nothing is swept.

A server that does not honour conditional puts cannot elect a sweeper: the tier then refuses
every write (`refusal`), with one error naming what to do, rather than grow past `capacity`.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import re
import time
from collections import Counter
from collections.abc import Callable

from tiering.errors import TierError
from tiering.units import format_size
from tiers.s3.background import Background
from tiers.s3.client import DELETE_BATCH, Bucket
from tiers.s3.lease import LEASE_TTL, Lease
from tiers.s3.use import Named, UseOrder

__all__ = ["SWEEP_BATCH", "SWEEP_PAGE", "Sweeper", "sweepable"]

log = logging.getLogger(__name__)

SWEEP_BATCH = 10_000
"""The oldest objects one pass keeps in memory to delete (~100 bytes each)."""
SWEEP_PAGE = 1000
"""Names listed at a time (S3's largest page)."""

_KVTIER_NAME = re.compile(r"[0-9a-f]{32}/(?:packs/[^/]+|([0-9a-f]{2})/\1[0-9a-f]*)")


def sweepable(name: str) -> bool:
    """Whether `name` (relative to the prefix) is an object kvtier writes: a block object or
    a pack of some namespace."""
    return _KVTIER_NAME.fullmatch(name) is not None


class Sweeper:
    """Sweeps `prefix` of `bucket` to `capacity` while `lease` is held (runtime's event
    loop)."""

    def __init__(
        self,
        bucket: Bucket,
        prefix: str,
        *,
        tier: str,
        capacity: int,
        interval: float,
        lease: Lease,
        counters: Counter[str],
        swept: Callable[[set[str]], object],
        use: UseOrder | None = None,
    ) -> None:
        """`interval`: `sweep_interval`; `swept`: told the names of the packs each delete
        request removed (the tier's own index forgets them at once); `use`: the live manifests
        of use (None: write order always)."""
        self.bucket = bucket
        self.prefix = prefix
        self.tier = tier
        self.capacity = capacity
        self.interval = interval
        self.lease = lease
        self.counters = counters
        self.swept = swept
        self.use = use
        self.order: Named | None = None
        """What the last pass that removed objects followed (`Named.by_use`)."""
        self.refusal: str | None = None
        """Why this tier refuses to write (the server cannot elect a sweeper), or None."""
        self.used: int | None = None
        """Bytes of kvtier's objects the last pass listed."""
        self._task = Background(f"tier {tier!r}: sweeper", self._run)

    def start(self) -> None:
        """See that the task runs (called by every write)."""
        self._task.ensure()

    async def stop(self) -> None:
        """End the task and give the lease up."""
        await self._task.stop()
        await self.lease.release()

    async def _run(self) -> None:
        failing = False
        next_pass = 0.0
        while True:
            wait = LEASE_TTL / 2
            try:
                if self.lease.supported is None and not await self.lease.probe():
                    self._refuse()
                    return
                if await self.lease.keep():
                    wait = LEASE_TTL / 3
                    if time.monotonic() >= next_pass:
                        more = await self.sweep()
                        next_pass = time.monotonic() + (0.0 if more else self.interval)
                    wait = min(wait, max(0.0, next_pass - time.monotonic()))
                failing = False
            except TierError as e:
                self.counters["sweep_errors"] += 1
                if not failing:
                    failing = True
                    log.warning("tier %r: sweeping %s failed (%s)", self.tier, self.prefix, e)
            await asyncio.sleep(wait)

    async def sweep(self) -> bool:
        """One pass: whether objects over `capacity` remain that it did not get to delete."""
        named = None if self.use is None else self.use.cached
        first: list[tuple[int, int, float, str, int]] = []  # the first to remove, unordered
        used = 0
        token: str | None = None
        while True:
            if not await self.lease.keep():  # renewed as due: a long listing keeps it
                return False
            page, token = await self.bucket.list_page(self.prefix, token, SWEEP_PAGE)
            for name, size, modified in page:
                if not sweepable(name[len(self.prefix) :]):
                    continue
                used += size
                if named is None:
                    rank, last = None, modified
                else:
                    rank = named.rank(self.prefix, name)
                    last = named.used(self.prefix, name, modified)
                first.append(
                    (0, 0, last, name, size) if rank is None else (1, -rank, last, name, size)
                )
                if len(first) >= 2 * SWEEP_BATCH:
                    first = heapq.nsmallest(SWEEP_BATCH, first)
            if token is None:
                break
        self.used = used
        self.counters["sweeps"] += 1
        excess = used - self.capacity
        if excess <= 0:
            return False
        if self.use is not None and named is None:
            await self.use.named()  # read once over capacity, then kept: sweep again at once
            if self.lease.held:
                await self.use.drop_expired()
            return True
        self.order = named if named is not None else Named()
        self.counters["sweeps_by_use" if self.order.by_use else "sweeps_write_order"] += 1
        chosen = []
        for *_, name, size in heapq.nsmallest(SWEEP_BATCH, first):
            if excess <= 0:
                break
            chosen.append((name, size))
            excess -= size
        for at in range(0, len(chosen), DELETE_BATCH):
            if not self.lease.held:
                return False
            batch = chosen[at : at + DELETE_BATCH]
            failed = await self.bucket.delete_names([name for name, _ in batch])
            self.counters["swept"] += len(batch) - failed
            self.counters["swept_bytes"] += sum(size for _, size in batch)
            self.swept({name for name, _ in batch if "/packs/" in name})
        return excess > 0

    def _refuse(self) -> None:
        self.refusal = (
            f"tier {self.tier!r}: capacity {format_size(self.capacity)} cannot be enforced:"
            f" {self.bucket.endpoint_url or 'the S3 server'} ignores conditional puts"
            " (If-None-Match), so no sweeper can hold the prefix's lease; set capacity: null"
            " and bound the bucket with a lifecycle rule"
        )
        log.error("%s; this tier writes nothing", self.refusal)
