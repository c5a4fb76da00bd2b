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

**Warm start** (`primary.warm_start`): after a restart the primary is empty while the file
tiers hold what the last engine wrote (its resident blocks too: `shutdown.resident`). The
newest of the indexed tiers' blocks, up to the budget, are read into free slots in the
background, one batch (`WARM_BATCH_BYTES`) at a time, as promotions that no lookup asked for:
a request that looks one up meanwhile waits on it like on its own promotion. Warming takes only
free slots above the write-back reserve (it never evicts), skips blocks the primary has or is
promoting, and stops for good when the primary has no room left, when a batch fails as a whole
(the tier is down: the engine's own promotions are not crowded out by retries; the breaker's
rule, `fault_of`, says what "as a whole" is), or when a reset or the shutdown begins. A batch
is a bulk job with a deadline of its own (`WARM_MIN_RATE`), and its time does not feed the
gate's estimate of the tier.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

from tiering.keys import BlockKey
from tiering.manager.jobs import Promotion, answers, get_into
from tiering.manager.locator import TierLocator
from tiering.manager.tierstate import TierState
from tiering.placement import BlockHistory, PromotionGate
from tiering.primary import LookupResult, PrimaryPool, StoreGrant
from tiering.runtime import Job, JobResult

__all__ = ["Promoter"]

log = logging.getLogger(__name__)

_PENDING, _MISS = LookupResult.PENDING, LookupResult.MISS

WARM_BATCH_BYTES = 64 << 20
"""Bytes one warm-start batch reads (at least one block): large enough for the tier to read at
its full rate, small enough that the engine's own promotions meanwhile share the medium with
one batch at most."""
WARM_MIN_RATE = 32 << 20
"""Bytes per second below which a warm-start batch times out (and the warm start ends): a
batch's deadline is its bytes at this rate, when that is longer than a promotion's. A disk
read beside a starting engine is far slower than alone (BENCHMARKS.md, "Time to first
token"), and no request waits on the batch."""


class Promoter:
    """The promotions queued and in flight. Scheduler process: `request` on the scheduler
    thread inside a step, the rest under the step lock (scheduler or runtime thread)."""

    def __init__(
        self,
        pool: PrimaryPool,
        tiers: Sequence[TierState],
        locator: TierLocator,
        history: BlockHistory,
        gate: PromotionGate,
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
        self.warm_budget = 0
        """Blocks a warm start may still read (`primary.warm_start`); 0: none, or it ended."""
        self._warm_plan: list[tuple[int, BlockKey]] = []
        """(tier index, key) still to read, the newest last (`plan_warm`)."""
        self.warming = False
        """A warm-start batch is in flight."""
        self.warm_keys: set[BlockKey] = set()
        """The keys of the warm-start batch in flight that no lookup has asked for (the
        engine waits on none of them), none of them late."""
        self.warm_asked = False
        """A lookup found a block of the warm-start batch in flight (the engine waits on it)."""
        self._warm_began = 0.0
        self._warm_over = False  # ended: nothing is read again
        self._warm_retried: set[BlockKey] = set()
        """Blocks whose warm read failed on its own (a tier call past its deadline beside a
        starting engine, say) and were queued once more."""

    def request(self, key: BlockKey, state: TierState) -> LookupResult:
        """A lookup found `key` in `state`'s tier: PENDING once queued, MISS when gated."""
        allows = self._gate_allows
        if allows is not None and not allows(state):
            state.counters["gated"] += 1
            return _MISS
        self.queued[state.index].append(key)
        self.promoting[key] = state.index
        return _PENDING

    def overdue(self) -> bool:
        """Whether a promotion in flight passed its deadline (checked without the lock)."""
        return bool(self._deadlines) and self._deadlines[0][0] <= self.clock()

    def mark_late(self, now: float) -> bool:
        """The promotions in flight past their deadline become late; whether any did."""
        deadlines, batch_of = self._deadlines, self._batch_of
        marked = False
        while deadlines and deadlines[0][0] <= now:
            _, seq, keys = heapq.heappop(deadlines)
            late = [key for key in keys if batch_of.get(key) == seq]
            self.late.update(late)
            self.warm_keys.difference_update(late)
            self.counters["promotions_late"] += len(late)
            marked = marked or bool(late)
        return marked

    def submit(
        self,
        outbox: list[Job],
        tag: Callable[..., Promotion],
        done: Callable[[JobResult], None],
    ) -> None:
        """Allocate primary slots for each tier's queued promotions and add their jobs to
        `outbox`. Keys that get no slot read as MISS during the next step."""
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
                self.counters["promotion_allocation_failures"] += len(refused)
            if grant.evicted:
                self.history.forget(grant.evicted)
                if self.write_back:
                    self.counters["demotions_dropped_direct_eviction"] += len(grant.evicted)
            if grant.keys:
                batch = list(zip(grant.keys, grant.slots, strict=True))
                self._submit_batch(outbox, tag, done, index, batch)
        self.queued.clear()

    def warm_unasked(self) -> bool:
        """A warm-start batch is in flight and no request waits on any of its blocks."""
        return self.warming and not self.warm_asked

    def warm_due(self) -> bool:
        """Whether a warm-start batch could be submitted now (read without the lock)."""
        return self.warm_budget > 0 and not self.warming

    def submit_warm(
        self,
        outbox: list[Job],
        tag: Callable[..., Promotion],
        done: Callable[[JobResult], None],
        *,
        room: int,
        block_bytes: int,
    ) -> None:
        """Add the next warm-start batch to `outbox`: blocks of one tier, newest first, at
        most `room` of them (free slots above the reserve) and `WARM_BATCH_BYTES`. Without
        room or blocks left, the warm start ends."""
        if not self.warm_due():
            return
        plan = self._warm_plan
        n = min(
            room,
            self.warm_budget,
            max(1, WARM_BATCH_BYTES // max(1, block_bytes)),
            max(1, self.pool.num_slots // 4),  # the engine's stores keep slots to evict
        )
        lookup, promoting = self.pool.lookup, self.promoting
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
            self.end_warm("no room left" if plan else "done")
            return
        grant = self.pool.allocate_for_promotion(keys)
        assert grant is not None and not grant.evicted, "a warm start took a slot in use"
        self.warm_budget -= len(grant.keys)
        self.warming = True
        self.warm_keys.update(grant.keys)
        self.warm_asked = False
        self.counters["warm_batches"] += 1
        batch = list(zip(grant.keys, grant.slots, strict=True))
        self._submit_batch(
            outbox,
            tag,
            done,
            index,
            batch,
            warm=True,
            deadline=len(batch) * block_bytes / WARM_MIN_RATE,
        )

    def plan_warm(self) -> None:
        """What the warm start will read: up to its budget of the blocks the indexed tiers hold
        now, each from the first tier that has it, the newest of the first tier first; kept
        reversed (popped from the end). Made once, when the manager is built (before the
        engine's requests: blocks the engine writes later are its own, not the last engine's).
        A tier whose listing fails is left out (logged)."""
        budget = self.warm_budget
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
        self._warm_plan = [(index, key) for key, index in reversed(plan.items())]
        self.warm_budget = min(budget, len(plan))
        self._warm_began = time.monotonic()
        if plan:
            log.info(
                "kvtier: warm start: reading %d blocks into the primary from %s",
                len(plan),
                ", ".join(sorted({self.tiers[i].config.name for i in plan.values()})),
            )

    def end_warm(self, why: str = "stopped") -> None:
        """No more warm-start batches (one in flight still ends as it would)."""
        if self.warm_budget or self.warming:
            self._said_end(why)
        self.warm_budget = 0
        self._warm_plan = []
        self._warm_over = True

    def _said_end(self, why: str) -> None:
        log.info(
            "kvtier: warm start ended (%s): %d blocks read in %.2f s",
            why,
            self.counters["blocks_warmed"],
            time.monotonic() - self._warm_began,
        )

    def _submit_batch(
        self,
        outbox: list[Job],
        tag: Callable[..., Promotion],
        done: Callable[[JobResult], None],
        index: int,
        batch: list[tuple[BlockKey, int]],
        warm: bool = False,
        deadline: float = 0.0,
    ) -> None:
        """One `get_many` job of `batch` (allocated WRITING) from tier `index`, with its
        deadline (at least `deadline`). A warm start's is a bulk job: the tier's latency
        breaker does not count its length."""
        state = self.tiers[index]
        promoting = self.promoting
        for key, _ in batch:
            promoting[key] = index
        deadline = max(self.deadline, len(batch) * self.recompute_per_block, deadline)
        seq = next(self._submissions)
        keys = [key for key, _ in batch]
        self._batch_of.update(dict.fromkeys(keys, seq))
        heapq.heappush(self._deadlines, (self.clock() + deadline, seq, keys))
        outbox.append(
            Job(
                state.config.name,
                functools.partial(get_into, state.tier, self.slot_view, batch),
                deadline,
                tag=tag(index, batch, warm),
                done=done,
                bulk=warm,
            )
        )

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

    def promoted(self, state: TierState, job: Promotion, result: JobResult) -> None:
        """A promotion's result: the blocks that arrived become ready, the others free their
        slots and are remembered as absent."""
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
        if job.warm:
            self.warming = False
            self.warm_keys.difference_update(key for key, _ in batch)
            self.counters["blocks_warmed"] += len(arrived)
            if not result.ok or result.fault is not None:
                self.counters["warm_stopped"] += 1
                self.end_warm(f"tier {state.config.name!r} failed")  # retrying would crowd it
            elif not self._warm_over:
                again = [
                    (job.tier, key)
                    for (key, _), ok in zip(batch, found, strict=True)
                    if isinstance(ok, BaseException) and key not in self._warm_retried
                ]
                if again:  # a block that failed alone (not absent, not corrupt): once more
                    self._warm_retried.update(key for _, key in again)
                    self._warm_plan += again
                    self.warm_budget += len(again)
                    self.counters["warm_retries"] += len(again)
                elif not self.warm_budget:
                    self._said_end("done")
        state.counters["promotion_seconds"] += result.seconds
        if arrived:
            self.pool.complete_promotion(arrived)
            state.counters["promotions"] += len(arrived)
            state.counters["bytes_promoted"] += len(arrived) * len(self.slot_view(batch[0][1]))
            if not job.warm:  # (a bulk read beside a starting engine says nothing of a request's)
                per_block = result.seconds / len(batch)
                previous = state.seconds_per_block
                state.seconds_per_block = (
                    per_block if previous is None else 0.8 * previous + 0.2 * per_block
                )
        if missing:
            self.pool.complete_promotion(missing, ok=False)
            if self.pool.events:
                self.failed += missing
            state.counters["promotion_failures"] += len(missing)
            self.locator.absent(missing, self.clock())

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
        self.warming = False
        self.warm_keys.clear()
        self.end_warm()
