"""The S3 tier's pack writer (`Packer`): one background task on the runtime's event loop that
writes the blocks waiting for a pack, a full pack at once and a partial one once its oldest
block has waited `pack_after`, so that a crash loses only the blocks of the last `pack_after`
(and of the pack writes in flight).

A put holds its block (`hold`) and returns: the pack is written off the caller's deadline, so a
deadline that ends a put never loses a batch. At most `writes` packs are written at once, and a
put waits (under its own deadline) while `limit` blocks are held in memory: a store that cannot
keep up slows the puts instead of filling memory. A pack whose write fails keeps its blocks,
first in line, and is tried again after a pause that doubles up to `RETRY_MAX`. The first pack
waits until the server's clock is known (pack names carry it: `tiers.s3.packformat`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from tiering.errors import TierError
from tiering.keys import BlockKey
from tiers.s3.background import Background
from tiers.s3.client import Bucket
from tiers.s3.packs import Packs

__all__ = ["RETRY_MAX", "RETRY_MIN", "Packer"]

log = logging.getLogger(__name__)

RETRY_MIN = 0.1
"""Seconds before a failed pack write is tried again (the pause doubles at each failure)."""
RETRY_MAX = 5.0
"""The longest pause between tries of a failed pack write."""
CLOCK_TRIES = 3
"""Answers without a `Date` after which packs are named by this host's clock (readers' full
listings find them all the same), rather than asking for the server's clock again."""


class Packer:
    """Writes `Packs`' pending blocks as packs; its task runs on the runtime's event loop."""

    def __init__(
        self,
        packs: Packs,
        bucket: Bucket,
        *,
        tier: str,
        counters: Counter[str],
        after: float,
        writes: int,
        limit: int,
        ready: Callable[[], Awaitable[None]],
    ) -> None:
        """`after`: `pack_after`, the longest a held block waits for its pack to be written;
        `writes`: packs written at once; `limit`: blocks held in memory before puts wait;
        `ready`: what to await before the first pack (a request whose answer tells the server's
        clock)."""
        self.packs = packs
        self.bucket = bucket
        self.tier = tier
        self.counters = counters
        self.after = after
        self.writes = writes
        self.limit = limit
        self.ready = ready
        self._task = Background(f"tier {tier!r}: pack writer", self._run)
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._slots = asyncio.Semaphore(writes)
        self._flying: set[asyncio.Task[None]] = set()
        self._pause = 0.0
        self._retry_at = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None

    async def hold(self, key: BlockKey, blob: bytes) -> None:
        """Hold `blob` as the pending object of `key`, waiting (under the caller's deadline)
        while `limit` blocks are held."""
        loop = asyncio.get_running_loop()
        if self._task.ensure() and loop is not self._loop:  # events bind to their first loop
            self._loop = loop
            self._wake, self._room = asyncio.Event(), asyncio.Event()
            self._slots = asyncio.Semaphore(self.writes)
        while self.packs.held() >= self.limit:
            self._room.clear()
            await self._room.wait()
        self.packs.hold(key, blob)
        self._wake.set()

    async def close(self) -> None:
        """Stop the task, let the pack writes in flight end, and write every block still
        pending (packs of at most `blocks_per_object`); once a pack cannot be written, the
        blocks not written are lost, counted (`blocks_lost`) and logged."""
        await self._task.stop()
        if self._flying:
            await asyncio.wait(self._flying)
        if not self.packs.pending():
            return
        # A pack named before the server's clock is known is named by this host's: readers'
        # full listings still find it.
        batches = self.packs.take_all()
        for done, batch in enumerate(batches):
            try:
                await self.packs.write(batch)
            except TierError as e:
                self.packs.take_all()  # back to pending: nothing will hold them now
                lost = sum(len(b) for b in batches[done:])
                self.counters["blocks_lost"] += lost
                log.error(
                    "tier %r: %d blocks waiting for a pack are lost at close (%s)",
                    self.tier,
                    lost,
                    e,
                )
                return

    # -- the task -----------------------------------------------------------------------------

    async def _run(self) -> None:
        pause = RETRY_MIN
        undated = 0  # answers that carried no clock (no `Date`): packs are then named locally
        while not self.bucket.clock_known and undated < CLOCK_TRIES:
            try:
                await self.ready()
            except TierError as e:
                log.warning("tier %r: no answer from the server (%s)", self.tier, e)
            else:
                if self.bucket.clock_known:
                    break
                undated += 1
                if undated == CLOCK_TRIES:
                    log.warning(
                        "tier %r: the server's answers carry no Date; packs are named by "
                        "this host's clock",
                        self.tier,
                    )
                    break
            await asyncio.sleep(pause)
            pause = min(RETRY_MAX, 2 * pause)
        while True:
            self._wake.clear()  # before looking: a hold from now on wakes the wait below
            wait: float | None = self._retry_at - time.monotonic()
            if wait is not None and wait <= 0:
                await self._slots.acquire()
                batch = self.packs.due(self.after)
                if batch is not None:
                    task = asyncio.ensure_future(self._write(batch))
                    self._flying.add(task)
                    task.add_done_callback(self._flying.discard)
                    continue
                self._slots.release()
                wait = self.packs.wait_for(self.after)
                wait = None if wait is None else max(wait, 0.001)
            try:
                async with asyncio.timeout(wait):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def _write(self, batch: dict[BlockKey, bytes]) -> None:
        try:
            await self.packs.write(batch)
            self.counters["packs_written"] += 1
            self._pause = 0.0
        except TierError as e:
            self.counters["pack_write_errors"] += 1
            self._pause = min(RETRY_MAX, max(RETRY_MIN, 2 * self._pause))
            self._retry_at = time.monotonic() + self._pause
            log.warning(
                "tier %r: writing a pack of %d blocks failed (%s); tried again in %gs",
                self.tier,
                len(batch),
                e,
                self._pause,
            )
        finally:
            self._slots.release()
            self._room.set()
            self._wake.set()
