"""The manifest's recorder: the runtime's thread (a task of its own on the runtime's loop),
and the shutdown's thread once, at the end.

Every `primary.warm_manifest_interval` seconds (0: only at shutdown) it takes the primary's
order of use under the step lock (`PrimaryPool.hottest`, one pass over the policy's keys,
never on the scheduler's thread: it tries the lock and tries again a tick later) and writes it
(`tiering.manager.manifest`) to every writable persistent tier that keeps records, one after
another, off the lock. A write that fails is logged once per tier and tried again at the next
interval; the last complete manifest stays where it was (a record is replaced atomically).

Bounded in size and rate: a manifest names at most the primary's slots (1 + key bytes each),
and the next periodic write waits the interval or `DUTY` times the last write's wall time
(its pass under the lock, encoding, and every tier's write), whichever is longer, so that the
recorder spends at most 1/`DUTY` of the runtime's time on manifests, however short the
interval or slow the tiers.

Once at start it writes the manifest the warm start follows (the last run's order, which the
engine has not replaced yet) under its own session: the store then says at once that an
engine of this identity is alive, so one started later with the same identity is told so
(`tiering.manager.manifest.clash`). Before every write it reads the record back from the first
tier: a record another live session wrote since is a clash, said once (both engines' manifests
would overwrite each other: give each its own `primary.engine_id`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence

from tiering.errors import TierError
from tiering.keys import BlockKey
from tiering.manager.counters import MANIFEST_CLASHES, MANIFESTS_WRITTEN
from tiering.manager.manifest import (
    Manifest,
    ManifestRefused,
    WarmProgress,
    clash,
    decode,
    encode,
    record_name,
)
from tiering.manager.steplock import StepLock
from tiering.primary import PrimaryPool
from tiering.runtime import TICK, Runtime
from tiering.tier import Tier

__all__ = ["DUTY", "ManifestRecorder"]

log = logging.getLogger(__name__)

DUTY = 100
"""A periodic write waits at least this many times the last one's wall time (1 %)."""


class ManifestRecorder:
    """One engine's manifest writes. Scheduler process: the runtime's loop, and `final` on the
    thread that shuts the manager down."""

    def __init__(
        self,
        pool: PrimaryPool,
        tiers: Sequence[Tier],
        lock: StepLock,
        runtime: Runtime,
        counters: dict[str, float],
        *,
        engine: str,
        interval: float,
        progress: Callable[[], WarmProgress],
        first: Sequence[BlockKey] | None = None,
    ) -> None:
        """`tiers`: those the manifest is written to (persistent, writable); `first`: the keys
        of the start's write (the manifest the warm start follows; None: no write at start,
        a manifest refused or unread stays until the first interval)."""
        self.pool, self.lock, self.runtime = pool, lock, runtime
        self.tiers = list(tiers)
        self.counters = counters
        self.engine, self.interval, self.progress = engine, interval, progress
        self.session = secrets.randbits(63)
        self.written = 0
        self.pause = interval
        """Seconds before the next periodic write: the interval, or `DUTY` times the last."""
        self._first = None if first is None else list(first)
        self._said: set[str] = set()
        self._clashed = False
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        if self.tiers:
            runtime.add_hook(self._on_tick)
            runtime.nudge()

    def manifest(self, keys: Sequence[BlockKey], *, ended: bool = False) -> Manifest:
        return Manifest(
            self.tiers[0].namespace,
            self.engine,
            keys,
            pid=os.getpid(),
            session=self.session,
            warm=self.progress(),
            ended=ended,
        )

    def close(self) -> None:
        """No periodic write more; one in flight is cancelled (a record is replaced whole)."""
        self._closed = True
        self.runtime.remove_hook(self._on_tick)
        task = self._task
        if task is not None and not task.done():
            with contextlib.suppress(RuntimeError):
                task.get_loop().call_soon_threadsafe(task.cancel)

    def final(self, timeout: float) -> None:
        """At shutdown (after the flush: the blocks are in the tiers first): the order of use
        now, written to every tier, waited for up to `timeout` seconds."""
        self.close()
        if not self.tiers:
            return
        with self.lock.held():
            keys = self.pool.hottest(self.pool.num_slots)
        try:
            self.runtime.run_sync(lambda: self.write(keys, ended=True), timeout)
        except Exception as e:  # noqa: BLE001 - a manifest never stops a shutdown
            log.warning("kvtier: the manifest at shutdown was not written: %s", e)

    def _on_tick(self) -> bool:
        if self._closed:
            return False
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.get_loop() is not loop:
            self._task = loop.create_task(self._record_forever(), name="kvtier-manifest")
        return False

    async def _record_forever(self) -> None:
        if self._first is not None:
            first, self._first = self._first, None
            await self.write(first)
        while not self._closed and self.interval > 0:
            await asyncio.sleep(self.pause)
            while not self.lock.try_acquire():
                await asyncio.sleep(TICK)
            began = time.perf_counter()
            try:
                keys = self.pool.hottest(self.pool.num_slots)
            finally:
                self.lock.release()
            await self.write(keys)
            self.pause = max(self.interval, DUTY * (time.perf_counter() - began))

    async def write(self, keys: Sequence[BlockKey], *, ended: bool = False) -> None:
        """Write a manifest of `keys` to every tier (the runtime's loop)."""
        await self._check()
        data = encode(self.manifest(keys, ended=ended))
        for tier in self.tiers:
            try:
                if await tier.write_record(record_name(self.engine), data):
                    self.counters[MANIFESTS_WRITTEN] += 1
            except (TierError, OSError) as e:
                if tier.name not in self._said:
                    self._said.add(tier.name)
                    log.warning(
                        "kvtier: tier %r: manifest not written (said once): %s", tier.name, e
                    )
        self.written += 1

    async def _check(self) -> None:
        """A record of another live session of this identity: a clash, said once."""
        if self._clashed:
            return
        tier = self.tiers[0]
        try:
            data = await tier.read_record(record_name(self.engine))
            if data is None:
                return
            found = decode(data, tier.namespace, self.engine)
        except (TierError, ManifestRefused):
            return
        why = clash(found, interval=self.interval, session=self.session)
        if why is not None:
            self._clashed = True
            self.counters[MANIFEST_CLASHES] += 1
            log.warning(
                "kvtier: engine identity %s is another live engine's too (%s): their manifests "
                "overwrite each other; give each engine its own primary.engine_id",
                self.engine,
                why,
            )
