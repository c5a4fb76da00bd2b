"""The S3 tier's pack index kept live (`Refresher`): its listings of the bucket's packs run on
the runtime's event loop, in the background, off every caller's deadline.

- **The load**: the first call starts one listing of every pack (`load`); calls wait for it
  under their own deadlines, and a failed load is started again by the next call.
- **Refreshes**, every `pack_refresh` seconds: a listing of only the packs named since the last
  complete one, less `PACK_LAG` (pack names sort by the server's clock, `tiers.s3.packformat`;
  the listing starts after the name of that time, `StartAfter`), at most `REFRESH_PAGES` pages
  (a listing cut short goes on where it stopped at the next refresh). A pack another engine
  wrote is therefore found within `pack_refresh` and a listing after its write ended, if that
  write took less than `PACK_LAG` (the name is taken when the write starts).
- **Full listings**, every `PACK_RELIST` seconds, beside the refreshes: they find what the
  refreshes cannot (packs of older kvtier versions, whose names carry no time; a write slower
  than `PACK_LAG`; a bucket full of planted names), and forget the packs gone from the bucket
  (swept, deleted), so that their entries neither fill the index's bound nor answer for blocks
  the bucket no longer has.

A listing reads only the indexes of packs it does not hold or has not refused (`Packs`): a
bucket full of planted packs costs each of them one read, once, within `MAX_PACKED`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

from tiering.errors import TierError, TierUnavailable
from tiers.s3.background import Background
from tiers.s3.client import Bucket
from tiers.s3.packformat import name_after
from tiers.s3.packs import Packs

__all__ = ["PACK_LAG", "PACK_PAGE", "PACK_RELIST", "REFRESH_PAGES", "Refresher"]

log = logging.getLogger(__name__)

PACK_PAGE = 1000
"""Pack names listed at a time (S3's largest page): a listing is never held whole."""
PACK_LAG = 10.0
"""Seconds before its last complete listing that a refresh lists from: what the pack names'
clocks (each writer's estimate of the server's, to about a second) and a pack's write (named
when it starts) may lag behind."""
PACK_RELIST = 60.0
"""Seconds between full listings of the bucket's packs."""
REFRESH_PAGES = 10
"""Pages one refresh lists at most."""


class Refresher:
    """Loads and refreshes `Packs` from the bucket's listings (runtime's event loop)."""

    def __init__(
        self,
        bucket: Bucket,
        packs: Packs,
        *,
        tier: str,
        counters: Counter[str],
        period: float,
        enabled: bool,
    ) -> None:
        """`period`: `pack_refresh`; `enabled`: whether the tier writes packs (without, the
        index is never loaded: `loaded` from the start)."""
        self.bucket = bucket
        self.packs = packs
        self.tier = tier
        self.counters = counters
        self.period = period
        self.loaded = not enabled
        """Whether every pack in the bucket has been listed once."""
        self.loading: asyncio.Task[None] | None = None
        """The load, while it runs or after it failed."""
        self.since: float | None = None
        """The server's time when the last complete listing started: every pack whose write
        had ended by then is held."""
        self._resume: str | None = None
        self._task = Background(f"tier {tier!r}: pack refresher", self._run)
        self._relist = Background(f"tier {tier!r}: pack relisting", self._relist_once)

    # -- from the tier's calls --------------------------------------------------------------------

    async def load(self) -> None:
        """Wait, under the caller's deadline, for the one background load of the packs'
        indexes, starting it when none runs (the first call, or the last load failed); once
        loaded, see that the refreshes run."""
        if self.loaded:
            if self.since is not None:
                self._task.ensure()
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
                # `stop` stopped the load: this caller was not cancelled, so it must not see a
                # cancellation
                raise TierUnavailable(f"tier {self.tier!r}: closed while loading packs") from None
            raise
        self._task.ensure()

    async def stop(self) -> None:
        """Cancel the load, the refreshes and a full listing, whichever run (the tier is
        closing)."""
        loading, self.loading = self.loading, None
        if loading is not None and not loading.done():
            loading.cancel()  # its pool calls already queued end at the pool's shutdown
            if loading.get_loop() is asyncio.get_running_loop():
                await asyncio.wait([loading])
        await self._task.stop()
        await self._relist.stop()

    async def _load_all(self) -> None:
        try:
            await self.full()
        except TierError as e:
            log.warning(
                "tier %r: loading pack indexes failed (%s); retried at the next call", self.tier, e
            )
            raise

    # -- listings -------------------------------------------------------------------------------

    async def full(self) -> None:
        """List every pack in the bucket: read the indexes of those not held yet, and forget
        the held ones the listing no longer names (gone from the bucket)."""
        known = self.packs.names()
        seen: set[str] = set()
        began = await self._listing(None, None, seen, known)
        assert began is not None  # an unlimited listing always completes or raises
        gone = known - seen
        if gone:
            self.counters["packs_gone"] += self.packs.drop(gone)
        self.since = began if self.since is None else max(self.since, began)
        self.loaded = True

    async def refresh(self) -> None:
        """List the packs named since the last complete listing (less `PACK_LAG`), or go on
        where the last refresh stopped."""
        if self.since is None:
            await self.full()
            return
        after = self._resume or name_after(self.packs.prefix, self.since - PACK_LAG)
        began = await self._listing(after, REFRESH_PAGES, None, None)
        if began is not None:
            self.since = max(self.since, began)

    async def _listing(
        self, after: str | None, pages: int | None, seen: set[str] | None, known: set[str] | None
    ) -> float | None:
        """List the packs (after `after`), reading the new ones' indexes; the server's time
        the listing started, or None when it stopped after `pages` pages (`_resume` says
        where it goes on). Adds to `seen` the names of `known` it lists."""
        started = time.monotonic()
        began = None
        token: str | None = None
        listed = 0
        while True:
            page, token = await self.bucket.list_page(self.packs.prefix, token, PACK_PAGE, after)
            if began is None:  # the first answer set the server's clock
                began = self.bucket.server_time() - (time.monotonic() - started)
            await self.packs.read_listed([(name, size) for name, size, _ in page])
            if seen is not None and known is not None:
                seen.update(name for name, _, _ in page if name in known)
            listed += 1
            if token is None:
                self._resume = None if after is not None else self._resume
                return began
            if pages is not None and listed >= pages:
                self._resume = page[-1][0] if page else self._resume
                return None

    # -- the task -----------------------------------------------------------------------------

    async def _run(self) -> None:
        relist_at = time.monotonic() + PACK_RELIST
        failing = False
        tick = time.monotonic()
        while True:
            tick = max(tick + self.period, time.monotonic())  # a period from start to start
            await asyncio.sleep(tick - time.monotonic())
            try:
                if time.monotonic() >= relist_at and not self._relist.running:
                    relist_at = time.monotonic() + PACK_RELIST
                    self._relist.ensure()
                await self.refresh()
                failing = False
            except TierError as e:
                self.counters["pack_refresh_errors"] += 1
                if not failing:
                    failing = True
                    log.warning(
                        "tier %r: refreshing the pack index failed (%s); tried again every %gs",
                        self.tier,
                        e,
                        self.period,
                    )

    async def _relist_once(self) -> None:
        try:
            await self.full()
        except TierError as e:
            self.counters["pack_refresh_errors"] += 1
            log.warning("tier %r: a full listing of the packs failed (%s)", self.tier, e)


def _retrieve(task: asyncio.Task[None]) -> None:
    """Mark a load's failure as seen: the callers that waited got it, and nobody else needs
    asyncio's "exception was never retrieved" at garbage collection."""
    if not task.cancelled():
        task.exception()
