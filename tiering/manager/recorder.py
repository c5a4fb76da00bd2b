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

At start it reads the record of its identity from every tier and says at once (one warning,
counted) when another live process wrote it (`tiering.manager.manifest.clash`: not at its
shutdown, within two intervals, another host or a live process of this one): two engines of one
identity overwrite each other's manifests; give each its own `primary.engine_id`. Then it writes
the manifest the warm start follows (the last run's order, which the engine has not replaced
yet) under its own session or, where no tier holds one, the order of use it has: either way the
store says at once that an engine of this identity is alive, so one started later is told too.
Before every write it reads the record back from the first tier, and says a clash found there
the same way (once).

Between writes it looks for a request to write now (`tiering.manager.request`: an operator's
`kvtier manifest --write-now`) every `primary.manifest_requests` seconds (`POLL` by default; 0:
never) in each of its tiers, answers one with a
write at once (no sooner than `FLOOR` seconds, nor `DUTY` times its wall time, after the last
write) and removes it; a request not sealed by the deployment's secret, or damaged, is removed
unanswered and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence

from tiering.errors import CorruptObject, TierError
from tiering.keys import BlockKey
from tiering.manager.counters import (
    MANIFEST_CLASHES,
    MANIFEST_REQUESTS,
    MANIFEST_REQUESTS_REFUSED,
    MANIFESTS_WRITTEN,
)
from tiering.manager.manifest import (
    Manifest,
    ManifestRefused,
    WarmProgress,
    clash,
    decode,
    encode,
    record_name,
)
from tiering.manager.request import (
    FLOOR,
    MAX_REQUEST_BYTES,
    POLL,
    ManifestRequest,
    decode_request,
    request_name,
)
from tiering.manager.steplock import StepLock
from tiering.primary import PrimaryPool
from tiering.runtime import TICK, Runtime
from tiering.tier import Tier

__all__ = ["DUTY", "ManifestRecorder"]

log = logging.getLogger(__name__)

DUTY = 100
"""A write waits at least this many times the last one's wall time (1 %), periodic or asked."""


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
        poll: float | None = None,
    ) -> None:
        """`tiers`: those the manifest is written to (persistent, writable); `first`: the keys
        of the start's write (the manifest the warm start follows; None: none followed, and
        the start writes the order of use it has where no tier holds a record of this
        identity; one refused or unread stays until the first interval); `poll`: seconds
        between two looks for a request to write now (0: none)."""
        self.pool, self.lock, self.runtime = pool, lock, runtime
        self.tiers = list(tiers)
        self.counters = counters
        self.engine, self.interval, self.progress = engine, interval, progress
        self.poll = POLL if poll is None else poll
        self.session = secrets.randbits(63)
        self.written = 0
        self.pause = interval
        """Seconds before the next periodic write: the interval, or `DUTY` times the last."""
        self._first = None if first is None else list(first)
        self._said: set[tuple[str, str]] = set()
        self._clashed = False
        self._task: asyncio.Task[None] | None = None
        self._due = self._earliest = 0.0
        """When the next periodic write is due, and the earliest a request may cause one."""
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
            interval=self.interval,
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
        first, self._first = self._first, None
        stored = await self._check(self.tiers)
        if first is not None or not stored:
            await self._timed(first)
        else:
            self._due = time.monotonic() + self.interval
        if not self._clashed:  # two starts at once: the later write is the one stored
            await self._check(self.tiers[:1])
        periodic, asked = self.interval > 0, self.poll > 0
        while not self._closed and (periodic or asked):  # neither: the shutdown's write alone
            now = time.monotonic()
            wakes = ([self._due] if periodic else []) + ([now + self.poll] if asked else [])
            await asyncio.sleep(max(TICK, min(wakes) - now))
            if periodic and time.monotonic() >= self._due:
                await self._timed()
            elif asked and time.monotonic() >= self._earliest:
                requests = await self._requests()
                if requests:
                    await self._timed()
                    await self._answered(requests)

    async def _timed(self, keys: Sequence[BlockKey] | None = None) -> None:
        """A write of `keys` (None: the order of use now, taken under the step lock, tried
        every tick, never waited for on the scheduler's thread), timed: the next periodic
        write waits the interval or `DUTY` times this one's wall time (the pass under the
        lock, encoding, every tier's write), a requested one `FLOOR` seconds or that."""
        if keys is None:
            while not self.lock.try_acquire():
                await asyncio.sleep(TICK)
            began = time.monotonic()
            try:
                keys = self.pool.hottest(self.pool.num_slots)
            finally:
                self.lock.release()
        else:
            began = time.monotonic()
        await self.write(keys)
        took = time.monotonic() - began
        self.pause = max(self.interval, DUTY * took)
        now = time.monotonic()
        self._due, self._earliest = now + self.pause, now + max(FLOOR, DUTY * took)

    async def write(self, keys: Sequence[BlockKey], *, ended: bool = False) -> None:
        """Write a manifest of `keys` to every tier (the runtime's loop)."""
        await self._check(self.tiers[:1])
        data = encode(self.manifest(keys, ended=ended))
        for tier in self.tiers:
            try:
                if await tier.write_record(record_name(self.engine), data):
                    self.counters[MANIFESTS_WRITTEN] += 1
            except (TierError, OSError) as e:
                self._say(tier, "manifest not written", e)
        self.written += 1

    def _say(self, tier: Tier, what: str, e: Exception) -> None:
        if (tier.name, what) not in self._said:
            self._said.add((tier.name, what))
            log.warning("kvtier: tier %r: %s (said once): %s", tier.name, what, e)

    async def _check(self, tiers: Sequence[Tier]) -> bool:
        """Whether a record of this identity is stored in `tiers` (or one could not say); a
        record of another live session is a clash, said once."""
        stored = False
        for tier in tiers:
            if self._clashed:
                return True
            try:
                data = await tier.read_record(record_name(self.engine))
                if data is None:
                    continue
                stored = True
                found = decode(data, tier.namespace, self.engine)
            except (TierError, ManifestRefused):
                stored = True
                continue
            why = clash(found, interval=self.interval, session=self.session)
            if why is not None:
                self._clashed = True
                self.counters[MANIFEST_CLASHES] += 1
                log.warning(
                    "kvtier: engine identity %s is another live engine's too (tier %r: %s): "
                    "their manifests overwrite each other; give each engine its own "
                    "primary.engine_id",
                    self.engine,
                    tier.name,
                    why,
                )
        return stored

    async def _requests(self) -> list[tuple[Tier, ManifestRequest]]:
        """The requests to write now stored in the tiers; one refused is removed, counted and
        said once."""
        name, found = request_name(self.engine), []
        for tier in self.tiers:
            try:
                data = await tier.read_record(name, MAX_REQUEST_BYTES)
                if data is not None:
                    found.append((tier, decode_request(data, self.engine)))
            except (CorruptObject, ManifestRefused) as e:
                self.counters[MANIFEST_REQUESTS_REFUSED] += 1
                self._say(tier, "a manifest request refused and removed", e)
                with contextlib.suppress(TierError):
                    await tier.delete_record(name)
            except TierError as e:
                self._say(tier, "manifest requests not read", e)
        return found

    async def _answered(self, asked: Sequence[tuple[Tier, ManifestRequest]]) -> None:
        """Each request answered, removed unless another replaced it meanwhile (that one is
        answered by the manifest just written too, but its asker may have read that first)."""
        self.counters[MANIFEST_REQUESTS] += 1
        log.info(
            "kvtier: manifest of engine %s written on request of %s",
            self.engine,
            ", ".join(sorted({request.asker() for _, request in asked})),
        )
        name = request_name(self.engine)
        for tier, request in asked:
            try:
                data = await tier.read_record(name, MAX_REQUEST_BYTES)
                if data is not None and decode_request(data, self.engine).nonce == request.nonce:
                    await tier.delete_record(name)
            except (TierError, ManifestRefused) as e:
                self._say(tier, "a manifest request not removed", e)
