"""Promotions: secondary tier -> primary.

A secondary hit that the gate lets through is queued (`request`: PENDING); between steps the
queued keys of each tier get primary slots (`allocate_for_promotion`, one batch per tier, as
many as fit) and one `get_many` job. Every request that needs the block waits on the same
promotion (`promoting`). A key that got no slot reads as MISS for the next step (`refused`).
A promotion past its deadline is late: its key reads as MISS (recompute) while the slot stays
WRITING until the tier lets go of it. A batch's deadline is `promotion.deadline`, or the time
recomputing its blocks would take (at `promotion.prefill_rate`) when that is longer: giving up
sooner would only make the request wait longer. A failed promotion frees the slot and the
block is remembered as absent for a while (`TierLocator.absent`).

A warm start's batches (`warm.WarmStart`) go through the same `submit_batch`, as bulk jobs:
their time does not feed the gate's estimate of the tier.
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from tiering.keys import BlockKey
from tiering.manager.counters import (
    BYTES_PROMOTED,
    DROPPED_DIRECT_EVICTION,
    GATED,
    PROMOTION_ALLOCATION_FAILURES,
    PROMOTION_FAILURES,
    PROMOTION_SECONDS,
    PROMOTIONS,
    PROMOTIONS_LATE,
)
from tiering.manager.jobs import JobSink, Promotion, answers
from tiering.manager.locator import TierLocator
from tiering.manager.tierstate import TierState
from tiering.placement import BlockHistory, PromotionGate
from tiering.primary import LookupResult, PrimaryPool, StoreGrant
from tiering.runtime import JobResult

__all__ = ["Promoter"]

_PENDING, _MISS = LookupResult.PENDING, LookupResult.MISS


class Promoter:
    """The promotions queued and in flight. Scheduler process: `request` on the scheduler
    thread inside a step, the rest under the step lock (scheduler or runtime thread)."""

    __slots__ = (
        "_batch_of",
        "_deadlines",
        "_gate_allows",
        "_submissions",
        "clock",
        "counters",
        "deadline",
        "failed",
        "gate",
        "history",
        "late",
        "locator",
        "pool",
        "promoting",
        "queued",
        "recompute_per_block",
        "refused",
        "sink",
        "slot_view",
        "tiers",
        "write_back",
    )

    def __init__(
        self,
        pool: PrimaryPool,
        tiers: Sequence[TierState],
        locator: TierLocator,
        history: BlockHistory,
        gate: PromotionGate,
        sink: JobSink,
        *,
        slot_view: Callable[[int], memoryview],
        deadline: float,
        counters: defaultdict[str, float],
        clock: Callable[[], float],
        write_back: bool,
        recompute_per_block: float = 0.0,
    ) -> None:
        self.pool = pool
        self.tiers = list(tiers)
        self.locator = locator
        self.history = history
        self.gate = gate
        self.sink = sink
        self._gate_allows = None if gate.always_open else gate.allows
        self.slot_view = slot_view
        self.deadline = deadline
        self.recompute_per_block = recompute_per_block
        """Seconds the engine takes to recompute one block: a batch's deadline is at least
        this per block."""
        self.counters = counters
        self.clock = clock
        self.write_back = write_back
        """Some tier demotes on eviction: a block evicted by a promotion's allocation is a
        dropped demotion (counted)."""
        self.queued: dict[int, list[BlockKey]] = defaultdict(list)
        """Tier index -> keys to promote from it, this step."""
        self.promoting: dict[BlockKey, int] = {}
        """Keys being promoted (queued this step or in flight), each with the index of the
        tier it comes from: the WRITING keys of the primary that the engine did not write, and
        those queued this step."""
        self.failed: list[BlockKey] = []
        """Keys whose promotion failed or got no slot since `take_failed` (with the pool's
        events only): a lookup may have answered PENDING for them, which the engine takes as
        residency to be told about."""
        self.refused: set[BlockKey] = set()
        """No slot at the end of the last step: MISS until the next step ends."""
        self.late: set[BlockKey] = set()
        """Keys whose promotion outlived `deadline`: MISS while their slots stay WRITING."""
        self._deadlines: list[tuple[float, int, list[BlockKey]]] = []
        """A heap of (deadline, submission number, keys) of the promotions in flight."""
        self._submissions = itertools.count()
        self._batch_of: dict[BlockKey, int] = {}
        """Key -> the submission number of the batch in flight promoting it (a heap entry of
        a batch that has ended must not mark a later promotion of its keys late)."""

    def request(self, key: BlockKey, state: TierState) -> LookupResult:
        """A lookup found `key` in `state`'s tier: PENDING once queued, MISS when gated."""
        allows = self._gate_allows
        if allows is not None and not allows(state):
            state.counters[GATED] += 1
            return _MISS
        self.queued[state.index].append(key)
        self.promoting[key] = state.index
        return _PENDING

    def overdue(self) -> bool:
        """Whether a promotion in flight passed its deadline (checked without the lock)."""
        return bool(self._deadlines) and self._deadlines[0][0] <= self.clock()

    def mark_late(self, now: float) -> list[BlockKey]:
        """The promotions in flight past their deadline become late: their keys."""
        deadlines, batch_of = self._deadlines, self._batch_of
        marked: list[BlockKey] = []
        while deadlines and deadlines[0][0] <= now:
            _, seq, keys = heapq.heappop(deadlines)
            late = [key for key in keys if batch_of.get(key) == seq]
            self.late.update(late)
            self.counters[PROMOTIONS_LATE] += len(late)
            marked += late
        return marked

    def submit(self) -> None:
        """Allocate primary slots for each tier's queued promotions and add their jobs to the
        sink. Keys that get no slot read as MISS during the next step."""
        pool = self.pool
        for index, keys in self.queued.items():
            if not keys:
                continue
            grant = pool.allocate_for_promotion(keys) or self._allocate_some(keys)
            if len(grant.keys) < len(keys):
                granted = set(grant.keys)
                left = [key for key in keys if key not in granted]
                promoting = self.promoting
                for key in left:
                    del promoting[key]
                refused = [key for key in left if pool.lookup(key) is _MISS]
                if pool.events:
                    self.failed += refused
                self.refused.update(refused)  # (the others became resident meanwhile)
                self.counters[PROMOTION_ALLOCATION_FAILURES] += len(refused)
            if grant.evicted:
                self.history.forget(grant.evicted)
                if self.write_back:
                    self.counters[DROPPED_DIRECT_EVICTION] += len(grant.evicted)
            if grant.keys:
                batch = list(zip(grant.keys, grant.slots, strict=True))
                self.submit_batch(index, batch)
        self.queued.clear()

    def submit_batch(
        self,
        index: int,
        batch: list[tuple[BlockKey, int]],
        *,
        bulk: bool = False,
        deadline: float = 0.0,
    ) -> None:
        """One `get_many` job of `batch` (allocated WRITING) from tier `index`, with its
        deadline (at least `deadline`). A `bulk` one (a warm start's) is a background
        transfer: the tier's latency breaker does not count its length, nor the gate its
        time."""
        state = self.tiers[index]
        promoting = self.promoting
        for key, _ in batch:
            promoting[key] = index
        deadline = max(self.deadline, len(batch) * self.recompute_per_block, deadline)
        seq = next(self._submissions)
        keys = [key for key, _ in batch]
        self._batch_of.update(dict.fromkeys(keys, seq))
        heapq.heappush(self._deadlines, (self.clock() + deadline, seq, keys))
        self.sink.promotion(state, self.slot_view, batch, deadline, bulk)

    def _allocate_some(self, keys: list[BlockKey]) -> StoreGrant:
        """As many of `keys` as the primary can take, in order (a batch that does not fit)."""
        new: list[BlockKey] = []
        slots: list[int] = []
        evicted: list[BlockKey] = []
        for key in keys:
            grant = self.pool.allocate_for_promotion([key])
            if grant is None:
                break
            new += grant.keys
            slots += grant.slots
            evicted += grant.evicted
        return StoreGrant(tuple(new), tuple(slots), tuple(evicted))

    def promoted(self, state: TierState, job: Promotion, result: JobResult) -> list[Any]:
        """A promotion's result: the blocks that arrived become ready, the others free their
        slots and are remembered as absent. The tier's answer per block (True: arrived)."""
        batch = job.batch
        found = answers(result, len(batch), False)
        arrived: list[BlockKey] = []
        missing: list[BlockKey] = []
        for (key, _), ok in zip(batch, found, strict=True):
            (arrived if ok is True else missing).append(key)
        promoting, batch_of = self.promoting, self._batch_of
        for key, _ in batch:
            promoting.pop(key, None)
            batch_of.pop(key, None)
        if self.late:
            self.late.difference_update(key for key, _ in batch)
        state.counters[PROMOTION_SECONDS] += result.seconds
        if arrived:
            self.pool.complete_promotion(arrived)
            state.counters[PROMOTIONS] += len(arrived)
            state.counters[BYTES_PROMOTED] += len(arrived) * len(self.slot_view(batch[0][1]))
            if not job.bulk:  # (a bulk read beside a starting engine says nothing of a request's)
                per_block = result.seconds / len(batch)
                previous = state.seconds_per_block
                state.seconds_per_block = (
                    per_block if previous is None else 0.8 * previous + 0.2 * per_block
                )
        if missing:
            self.pool.complete_promotion(missing, ok=False)
            if self.pool.events:
                self.failed += missing
            state.counters[PROMOTION_FAILURES] += len(missing)
            self.locator.absent(missing, self.clock())
        return found

    def pending(self) -> bool:
        """Queued promotions not yet submitted."""
        return any(self.queued.values())

    def take_failed(self) -> list[BlockKey]:
        """The keys of failed promotions since the last call that are neither resident nor
        being promoted again."""
        failed, self.failed = self.failed, []
        lookup, promoting = self.pool.lookup, self.promoting
        # A key queued again (from another tier) reads PENDING again: it is not removed.
        return [
            key for key in dict.fromkeys(failed) if key not in promoting and lookup(key) is _MISS
        ]

    def clear(self) -> None:
        self.queued.clear()
        self.promoting.clear()
        self.failed.clear()
        self.refused.clear()
        self._deadlines.clear()
        self._batch_of.clear()
        self.late.clear()
