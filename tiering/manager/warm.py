"""The warm start (`primary.warm_start`): a restarted engine's primary filled from its tiers.

After a restart the primary is empty while the tiers hold what the last engine wrote (its resident
blocks too: `shutdown.resident`). What is read follows the last run's manifest of use
(`tiering.manager.manifest`: its keys hottest first, from whichever tier holds each, files,
segments, Redis or S3; a key no tier holds is skipped and counted) or, without a usable one, the
newest of the indexed tiers' blocks; up to the budget, they are read into free slots in the
background, one batch (`WARM_BATCH_BYTES`) at a time, as promotions that no lookup asked for
(`Promoter.submit_batch`, bulk): a request that looks one up meanwhile waits on it like on its own
promotion. Warming takes only free slots above the write-back reserve (it never evicts), skips
blocks the primary has or is promoting, and stops for good when the primary has no room left, when
a batch fails as a whole (the tier is down: the engine's own promotions are not crowded out by
retries; the breaker's rule, `fault_of`, says what "as a whole" is), or when a reset or the
shutdown begins. A batch is a bulk job with a deadline of its own (`WARM_MIN_RATE`), and its time
does not feed the gate's estimate of the tier.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from tiering.keys import BlockKey
from tiering.manager.counters import (
    BLOCKS_WARMED,
    WARM_BATCHES,
    WARM_PLANNED,
    WARM_REMAINING,
    WARM_RETRIES,
    WARM_SKIPPED,
    WARM_SOURCE,
    WARM_STOPPED,
)
from tiering.manager.jobs import Promotion
from tiering.manager.manifest import SOURCES, Manifest, WarmProgress
from tiering.manager.promotion import Promoter
from tiering.manager.tierstate import TierState
from tiering.primary import LookupResult, PrimaryPool
from tiering.runtime import JobResult

__all__ = ["WARM_BATCH_BYTES", "WARM_MIN_RATE", "WarmStart"]

log = logging.getLogger(__name__)

_MISS = LookupResult.MISS

WARM_BATCH_BYTES = 64 << 20
"""Bytes one warm-start batch reads (at least one block): large enough for the tier to read at
its full rate, small enough that the engine's own promotions meanwhile share the medium with
one batch at most."""
WARM_MIN_RATE = 32 << 20
"""Bytes per second below which a warm-start batch times out (and the warm start ends): a
batch's deadline is its bytes at this rate, when that is longer than a promotion's. A disk
read beside a starting engine is far slower than alone (BENCHMARKS.md, "Time to first
token"), and no request waits on the batch."""


class WarmStart:
    """One engine's warm start. Scheduler process: built on the scheduler's thread (the plan is
    made then), the rest under the step lock (mostly the runtime's thread); `due` and
    `unasked` are read without it."""

    __slots__ = (
        "_began",
        "_over",
        "_plan",
        "_retried",
        "_why",
        "source",
        "asked",
        "block_bytes",
        "budget",
        "counters",
        "keys",
        "pool",
        "promoter",
        "reserve",
        "tiers",
        "warming",
    )

    def __init__(
        self,
        pool: PrimaryPool,
        tiers: Sequence[TierState],
        promoter: Promoter,
        counters: defaultdict[str, float],
        *,
        budget: int,
        block_bytes: int,
        reserve: int,
        manifest: Manifest | None = None,
        why: str = "",
    ) -> None:
        """`budget`: blocks to read at most (0: no warm start); `reserve`: free slots a batch
        leaves to the write-back demotions; `manifest`: the last run's order of use to follow
        (None: the tiers' newest), `why`: the line saying where it came from or why there is
        none. The plan is made here (`plan`)."""
        self.pool = pool
        self.tiers = list(tiers)
        self.promoter = promoter
        self.counters = counters
        self.block_bytes = block_bytes
        self.reserve = reserve
        self.budget = min(budget, pool.num_slots)
        """Blocks the warm start may still read; 0: none, or it ended."""
        self._plan: list[tuple[int, BlockKey]] = []
        """(tier index, key) still to read, the newest last (`plan`)."""
        self.warming = False
        """A batch is in flight."""
        self.keys: set[BlockKey] = set()
        """The keys of the batch in flight that no lookup has asked for (the engine waits on
        none of them), none of them late."""
        self.asked = False
        """A lookup found a block of the batch in flight (the engine waits on it)."""
        self._began = 0.0
        self._over = False  # ended: nothing is read again
        self._retried: set[BlockKey] = set()
        """Blocks whose read failed on its own (a tier call past its deadline beside a
        starting engine, say) and were queued once more."""
        self.source = "none"
        """What the plan follows (`tiering.manager.manifest.SOURCES`)."""
        self._why = why
        if self.budget:
            if manifest is not None:
                self.follow(manifest)
            else:
                self.plan()  # what the tiers hold now, before any request

    def progress(self) -> WarmProgress:
        """Planned, read, skipped and remaining, and what the plan follows."""
        c = self.counters
        return WarmProgress(
            self.source,
            int(c[WARM_PLANNED]),
            int(c[BLOCKS_WARMED]),
            int(c[WARM_SKIPPED]),
            int(c[WARM_REMAINING]),
        )

    def follow(self, manifest: Manifest) -> None:
        """Plan the manifest's keys, hottest first, up to the budget, each from the first
        indexed tier that holds it, else from the first tier without an index (Redis, S3:
        asked with the batch itself; a miss there goes on to the next such tier). A key no
        tier can hold is skipped and counted."""
        budget = self.budget
        unindexed = [s.index for s in self.tiers if not s.indexed]
        plan: dict[BlockKey, int] = {}
        skipped = 0
        for key in manifest.keys:
            if len(plan) >= budget:
                break
            if key in plan:
                continue
            where = next((s.index for s in self.tiers if s.indexed and s.tier.knows(key)), None)
            if where is None:
                where = next(
                    (s.index for s in self.tiers if s.indexed and s.tier.knows(key) is None),
                    unindexed[0] if unindexed else None,
                )
            if where is None:
                skipped += 1
                continue
            plan[key] = where
        self.counters[WARM_SKIPPED] += skipped
        self._start(plan, "manifest", f"{self._why}; {skipped} of its blocks no tier holds")

    def due(self) -> bool:
        """Whether a batch could be submitted now (read without the lock)."""
        return self.budget > 0 and not self.warming

    def unasked(self) -> bool:
        """A batch is in flight and no request waits on any of its blocks."""
        return self.warming and not self.asked

    def ask(self, key: BlockKey) -> None:
        """A lookup found `key` PENDING: if it is the batch's, the engine now waits on it."""
        if key in self.keys:
            self.keys.discard(key)
            self.asked = True

    def late(self, keys: list[BlockKey]) -> None:
        """`keys`' promotions turned late: the engine no longer waits on them either way."""
        self.keys.difference_update(keys)

    def plan(self) -> None:
        """What the warm start will read: up to its budget of the blocks the indexed tiers hold
        now, each from the first tier that has it, the newest of the first tier first; kept
        reversed (popped from the end). Made once, when the manager is built (before the
        engine's requests: blocks the engine writes later are its own, not the last engine's),
        when there is no usable manifest. A tier whose listing fails is left out (logged)."""
        budget = self.budget
        plan: dict[BlockKey, int] = {}
        for state in self.tiers:
            if len(plan) >= budget:
                break
            if not state.indexed:
                continue
            try:
                newest = state.tier.newest(budget)
            except Exception:  # a tier's bug must not stop the engine from starting
                log.exception("kvtier: warm start: tier %r cannot list its blocks", state.tier.name)
                continue
            for key in newest:
                plan.setdefault(key, state.index)
                if len(plan) >= budget:
                    break
        self._start(plan, "newest", self._why or "no manifest asked for")

    def _start(self, plan: dict[BlockKey, int], source: str, why: str) -> None:
        self._plan = [(index, key) for key, index in reversed(plan.items())]
        self.budget = min(self.budget, len(plan))
        self._began = time.monotonic()
        self.source = source
        self.counters[WARM_SOURCE] = SOURCES.index(source)
        self.counters[WARM_PLANNED] += len(plan)
        self.counters[WARM_REMAINING] = len(plan)
        log.info(
            "kvtier: warm start: reading %d blocks into the primary from %s, following %s (%s)",
            len(plan),
            ", ".join(sorted({self.tiers[i].config.name for i in plan.values()})) or "no tier",
            "the last run's manifest of use" if source == "manifest" else "the tiers' newest",
            why,
        )

    def submit(self) -> None:
        """Submit the next batch: blocks of one tier, newest first, into free slots above the
        reserve (a warmed block that took the reserve would be demoted again at once), at most
        `WARM_BATCH_BYTES`. Without room or blocks left, the warm start ends."""
        if not self.due():
            return
        pool, plan = self.pool, self._plan
        n = min(
            pool.num_free - self.reserve,
            self.budget,
            max(1, WARM_BATCH_BYTES // max(1, self.block_bytes)),
            max(1, pool.num_slots // 4),  # the engine's stores keep slots to evict
        )
        lookup, promoting = pool.lookup, self.promoter.promoting
        keys: list[BlockKey] = []
        index = -1
        while plan and len(keys) < n:
            tier, key = plan[-1]
            if lookup(key) is not _MISS or key in promoting:
                plan.pop()  # resident, or promoted for a request meanwhile
                continue
            if keys and tier != index:
                break  # one tier per batch
            plan.pop()
            index = tier
            keys.append(key)
        if not keys:
            self.end("no room left" if plan else "done")
            return
        grant = pool.allocate_for_promotion(keys)
        assert grant is not None and not grant.evicted, "a warm start took a slot in use"
        self.budget -= len(grant.keys)
        self.counters[WARM_REMAINING] = len(plan) + len(grant.keys)
        self.warming = True
        self.keys.update(grant.keys)
        self.asked = False
        self.counters[WARM_BATCHES] += 1
        batch = list(zip(grant.keys, grant.slots, strict=True))
        self.promoter.submit_batch(
            index, batch, bulk=True, deadline=len(batch) * self.block_bytes / WARM_MIN_RATE
        )

    def promoted(
        self, state: TierState, job: Promotion, result: JobResult, found: list[Any]
    ) -> None:
        """A batch's result (`found`: the tier's answer per block, as `Promoter.promoted` read
        it): a batch that failed as a whole ends the warm start (retrying would crowd the
        tier); a block that failed alone (not absent, not corrupt) is read once more."""
        batch = job.batch
        self.warming = False
        self.keys.difference_update(key for key, _ in batch)
        self.counters[BLOCKS_WARMED] += sum(1 for ok in found if ok is True)
        if result.ok and result.fault is None and self.source == "manifest":
            self._absent(job, found)
        self.counters[WARM_REMAINING] = len(self._plan)
        if not result.ok or result.fault is not None:
            self.counters[WARM_STOPPED] += 1
            self.end(f"tier {state.config.name!r} failed")
        elif not self._over:
            again = [
                (job.tier, key)
                for (key, _), ok in zip(batch, found, strict=True)
                if isinstance(ok, BaseException) and key not in self._retried
            ]
            if again:
                self._retried.update(key for _, key in again)
                self._plan += again
                self.budget += len(again)
                self.counters[WARM_RETRIES] += len(again)
            elif not self.budget:
                self._said_end("done")

    def _absent(self, job: Promotion, found: list[Any]) -> None:
        """A manifest's blocks the batch's tier did not have: asked of the next tier without
        an index (their slots were freed by the promoter), or skipped and counted."""
        later = [s.index for s in self.tiers if not s.indexed and s.index > job.tier]
        again: list[tuple[int, BlockKey]] = []
        for (key, _), ok in zip(job.batch, found, strict=True):
            if ok is False:
                if later and not self._over:
                    again.append((later[0], key))
                else:
                    self.counters[WARM_SKIPPED] += 1
        if again:
            self._plan += again
            self.budget += len(again)

    def end(self, why: str = "stopped") -> None:
        """No more batches (one in flight still ends as it would)."""
        if self.budget or self.warming:
            self._said_end(why)
        self.budget = 0
        self._plan = []
        self._over = True
        self.counters[WARM_REMAINING] = 0

    def clear(self) -> None:
        """A reset: the batch in flight is forgotten (its result will be dropped), and no more
        are read."""
        self.warming = False
        self.keys.clear()
        self.end()

    def _said_end(self, why: str) -> None:
        p = self.progress()
        log.info(
            "kvtier: warm start ended (%s): following %s, %d planned, %d read, %d skipped, "
            "%d not read, in %.2f s",
            why,
            p.source,
            p.planned,
            p.read,
            p.skipped,
            max(0, p.planned - p.read - p.skipped),
            time.monotonic() - self._began,
        )
