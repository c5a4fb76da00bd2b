"""The tiers' store-wide usage, polled in the background: the runtime's thread (a task of its
own on the runtime's loop), read by the stats snapshot on any thread.

Every `metrics.usage_interval` seconds (0: never) the poller asks each tier, one after another,
what its whole store holds (`Tier.usage`: every namespace at the tier's location, whoever
wrote it), each call under a deadline of one interval, and keeps per tier the objects, bytes
and namespaces of the store, this engine's namespace's share, and when they were taken. A tier
whose call fails or passes its deadline keeps its last figures and counts `usage_failures`.

The poll is no job of the runtime's: it passes no breaker (a slow or failing listing of a whole
store says nothing of the data path, and must not cut a tier off), it is not work the engine
waits for (`has_pending_work`), and a reset or the shutdown's flush never waits for it. A poll
begins at least one interval after the last one began, and at least `SPACING` times the last
poll's length after it ended: however large a store grows, listing it takes at most a
`SPACING + 1`th of the time.

Started at the runtime's first tick once built (its hook makes the task on the loop it runs on;
a forked child's fresh loop gets a fresh one), stopped by `close`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from tiering.manager.counters import USAGE_FAILURES
from tiering.manager.tierstate import TierState
from tiering.runtime import Runtime

__all__ = ["SPACING", "USAGE_GAUGES", "UsagePoller"]

log = logging.getLogger(__name__)

SPACING = 10.0
"""A poll waits at least this many times the last one's length after it ended."""
USAGE_GAUGES = {
    "usage_objects": "Objects in the tier's whole store (every namespace, every engine's).",
    "usage_bytes": "Bytes in the tier's whole store (every namespace, every engine's).",
    "usage_namespaces": "Namespaces with objects in the tier's store.",
    "usage_own_objects": "Objects of this engine's namespace in the tier's store.",
    "usage_own_bytes": "Bytes of this engine's namespace in the tier's store.",
    "capacity_bytes": "Bytes the tier may hold (its capacity); absent when unbounded.",
}
"""What a tier's row of the stats snapshot holds once a poll has answered (gauges; the
documentation is what the metrics endpoints say)."""


class UsagePoller:
    """The usage figures of the manager's tiers. Scheduler process: polls on the runtime's
    thread; `figures` is read from any thread (each tier's row is replaced whole, never
    changed in place); `close` from the thread that shuts the manager down."""

    def __init__(
        self,
        tiers: Sequence[TierState],
        runtime: Runtime,
        interval: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tiers = list(tiers)
        self.interval = interval
        self.clock = clock
        self.polls = 0
        """Polls ended (every tier asked once)."""
        self._rows: dict[str, dict[str, Any]] = {state.name: {} for state in self.tiers}
        self._failures = dict.fromkeys(self._rows, 0)
        self._said: set[str] = set()  # tiers whose failure was logged (once each)
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        if interval > 0 and self.tiers:
            runtime.add_hook(self._on_tick)
            runtime.nudge()  # the first poll begins at the runtime's first tick

    def figures(self, tier: str) -> dict[str, Any]:
        """The usage gauges of `tier` (empty before its first answer) and `usage_failures`."""
        return {**self._rows.get(tier, {}), USAGE_FAILURES: self._failures.get(tier, 0)}

    def close(self) -> None:
        """No poll more; the one in flight is cancelled."""
        self._closed = True
        task = self._task
        if task is not None and not task.done():
            with contextlib.suppress(RuntimeError):  # the loop is closed already
                task.get_loop().call_soon_threadsafe(task.cancel)

    def _on_tick(self) -> bool:
        """The runtime's hook: start the polling task on this loop, once. No work to report
        (the runtime may sleep: the task runs on its own)."""
        if self._closed:
            return False
        loop = asyncio.get_running_loop()
        task = self._task
        if task is None or task.get_loop() is not loop:
            self._task = loop.create_task(self._poll_forever(), name="kvtier-usage")
        return False

    async def _poll_forever(self) -> None:
        while not self._closed:
            began = self.clock()
            await self.poll()
            took = self.clock() - began
            await asyncio.sleep(max(self.interval - took, SPACING * took))

    async def poll(self) -> None:
        """Ask every tier once (on the runtime's loop)."""
        for state in self.tiers:
            if self._closed:
                return
            await self._poll_one(state)
        self.polls += 1

    async def _poll_one(self, state: TierState) -> None:
        tier = state.tier
        try:
            usage = await tier.usage(self.interval)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure keeps the last figures, counted
            self._failures[state.name] += 1
            if state.name not in self._said:
                self._said.add(state.name)
                log.warning(
                    "tier %r: usage not listed (%s); its last figures stay (said once)",
                    state.name,
                    " ".join(str(e).split()) or type(e).__name__,
                )
            return
        own = [u for u in usage if u.namespace == tier.namespace]
        row: dict[str, Any] = {
            "usage_objects": sum(u.objects for u in usage),
            "usage_bytes": sum(u.bytes_used for u in usage),
            "usage_namespaces": len(usage),
            "usage_own_objects": sum(u.objects for u in own),
            "usage_own_bytes": sum(u.bytes_used for u in own),
        }
        if tier.capacity is not None:
            row["capacity_bytes"] = tier.capacity
        self._rows[state.name] = row  # replaced whole: readers see the old or the new
