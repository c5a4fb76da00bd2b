"""`TieringOffloadingManager`: the CPU primary pool plus secondary tiers.

Scheduler process: called on the scheduler's thread, with its bookkeeping on the runtime's
(**Threads**, below). It serves the primary pool's contract (so the vLLM adapter serves it
unchanged) and moves blocks between the primary and the tiers on the runtime, never waiting on
I/O. It is a facade over one object per concept:

- `StepLock` (`steplock`): the lock the scheduler holds for a step;
- `TierLocator` (`locator`): where each block is known to be, with its TTLs, and the batched
  existence checks of the tiers without an index;
- `Promoter` (`promotion`): promotions queued and in flight, late and refused ones;
- `Demoter` (`demotion`): the three write modes, reclaim and back-pressure;
- placement policies (`tiering.placement`): the tiers' admission and the promotion gate;
- `StoreRefusals` (`refusals`), `StatsSnapshot` (`stats`), the job records (`jobs`), and
  `UsagePoller` (`usage`: the tiers' store-wide usage, polled apart from the jobs).

- **lookup**: the primary first, then the `indexed` tiers (memory, file: they know what they
  hold without I/O), in order. A key none of them has is looked for in the other tiers (Redis,
  S3), and in an indexed tier that cannot say (a `files` directory other engines write), by
  one batched existence check per tier, submitted at the end of the step; meanwhile the
  answer is RETRY. Once a tier (the first, in order) has it, and the gate lets it through, a
  primary slot is allocated (WRITING) and the promotion queued: PENDING, then HIT once the
  bytes are in.
- **demotion**, per tier: `through`, `back`, `selective` (`demotion`); at most `max_inflight`
  blocks per tier in flight.
- **gating** (`promotion.gate`, a name in `tiering.placement.registry`): `auto` promotes a
  tier's hit only while its measured time per block beats recomputing the block at
  `prefill_rate` tokens per second.
- **faults**: every job has a deadline and goes through the tier's circuit breaker, demotions
  through its write breaker too (`tiering.runtime`: a full tier refuses writes and still serves
  promotions); failures are misses, dropped demotions and counters, never exceptions. A
  primary store that cannot be granted is counted and said once (`StoreRefusals`). A tier
  that cannot stop its I/O at once (the file tier's threads read into primary slots) ends its
  job late rather than let a slot be reused under it; meanwhile a late promotion's key reads
  as MISS (recompute).

The manager opens no socket and touches no file: `publish`, when given, receives `snapshot()`
at the end of every step (the connector's Prometheus endpoint serves it).

**Threads.** The scheduler's calls do only what must be answered now; the runtime's thread does
the rest, under the step lock (`lock`): it applies finished jobs (promoted blocks become ready,
demoted blocks' slots are given back) and, between steps, submits the existence checks and
promotions the step queued (allocating their slots), pins write-through blocks and reclaims
slots for write-back demotions. In vLLM that work runs while the model does, not in the
scheduler's step. The scheduler holds the lock from a step's first `lookup` to
`on_schedule_end` (one acquisition per step, not one per call), so a block looked up as HIT is
never reclaimed or evicted before the same step's `prepare_load`; other calls take it one at a
time. The runtime never waits for the lock: it tries, and tries again a tick later. If it missed
a whole window between two steps, `on_schedule_end` does the work itself. Every method that
touches shared state asserts that its thread holds the lock (`StepLock.owned`).

Over 400 lines, a third of them this map: the facade is the primary's whole contract plus the
runtime's hook; each method delegates to the pieces, which hold the logic.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from contextlib import AbstractContextManager
from typing import Any

from tiering import gil
from tiering.config import Config, TierConfig
from tiering.errors import StateError
from tiering.keys import BlockKey
from tiering.manager.demotion import Demoter
from tiering.manager.jobs import Demotion, ExistenceCheck, Promotion, SlotHold, TierJob, answers
from tiering.manager.locator import ABSENT, TierLocator
from tiering.manager.promotion import Promoter
from tiering.manager.refusals import StoreRefusals
from tiering.manager.stats import StatsSnapshot
from tiering.manager.steplock import StepLock
from tiering.manager.tierstate import TierEvent, TierState
from tiering.manager.usage import UsagePoller
from tiering.placement import BlockHistory, PromotionGate, gate_class
from tiering.primary import LookupResult, PrimaryEvent, PrimaryPool, StoreGrant
from tiering.runtime import Job, JobResult, Runtime
from tiering.tier import Tier

__all__ = ["TieringOffloadingManager"]

IDLE_WAIT = 0.005
"""Seconds an empty engine step waits at most for a promotion or existence check to end: new
requests reach an otherwise idle engine at most this much later."""

# Plain globals: cheaper than an enum member's attribute on the lookup path (BENCHMARKS.md,
# "Scheduler-side cost of the primary pool").
_HIT, _PENDING, _MISS, _RETRY = (
    LookupResult.HIT,
    LookupResult.PENDING,
    LookupResult.MISS,
    LookupResult.RETRY,
)


class TieringOffloadingManager:
    """The primary pool's API over the primary plus tiers. Scheduler process: the public methods
    are called from one thread (the scheduler's); the runtime's thread works alongside under
    `lock` (module docstring)."""

    def __init__(
        self,
        pool: PrimaryPool,
        tiers: Sequence[tuple[TierConfig, Tier]],
        slot_view: Callable[[int], memoryview],
        *,
        config: Config,
        runtime: Runtime,
        block_tokens: int,
        reserve: int | None = None,
        max_inflight: int = 256,
        clock: Callable[[], float] = time.monotonic,
        gate: PromotionGate | None = None,
        publish: Callable[[Mapping[str, Any]], None] | None = None,
    ) -> None:
        """`gate` replaces the one `promotion.gate` names; `publish` receives `snapshot()` at
        the end of every step, under the lock (it must not block)."""
        self.pool = pool
        self.tiers = [TierState.of(cfg, tier, i) for i, (cfg, tier) in enumerate(tiers)]
        self.slot_view = slot_view
        self.config = config
        self.runtime = runtime
        self.block_tokens = block_tokens
        self.clock = clock
        self.counters: defaultdict[str, float] = defaultdict(float)
        self.lock = StepLock(forbidden=runtime.on_loop_thread)
        """Guards the pool and every piece below between the scheduler's calls and the
        runtime's bookkeeping. Held by the scheduler from a step's first `lookup` to
        `on_schedule_end`; `quiet()` holds it from outside."""
        policies = [policy for state in self.tiers for policy in state.admission]
        self.history = BlockHistory(
            tracks_hits=any(p.needs_hits for p in policies),
            tracks_age=any(p.needs_age for p in policies),
        )
        if gate is None:
            gate = gate_class(config.promotion.gate)(
                block_tokens=block_tokens, prefill_rate=config.promotion.prefill_rate
            )
        self.locator = TierLocator(self.tiers)
        self.demoter = Demoter(
            pool,
            self.tiers,
            self.locator,
            self.history,
            slot_view=slot_view,
            timeout=config.faults.timeout,
            reserve=max(1, pool.num_slots // 10) if reserve is None else reserve,
            max_inflight=max_inflight,
            counters=self.counters,
            clock=clock,
        )
        self.promoter = Promoter(
            pool,
            self.tiers,
            self.locator,
            self.history,
            gate,
            slot_view=slot_view,
            deadline=config.promotion.deadline,
            recompute_per_block=block_tokens / config.promotion.prefill_rate,
            counters=self.counters,
            clock=clock,
            write_back=bool(self.demoter.write_back),
        )
        self.refusals = StoreRefusals(pool, slot_view, config.primary.capacity, self.counters)
        self.usage = UsagePoller(self.tiers, runtime, config.metrics.usage_interval)
        self._block_bytes = len(slot_view(0))
        if any(state.indexed for state in self.tiers):
            warm = config.primary.warm_start // max(1, self._block_bytes)
            self.promoter.warm_budget = min(warm, pool.num_slots)
            if self.promoter.warm_budget:
                self.promoter.plan_warm()  # what the tiers hold now, before any request
        self._warm_keys = self.promoter.warm_keys
        self._publish = publish
        self._generation = 0  # bumped by `reset`: results of older jobs are dropped
        self._step = 0  # `on_schedule_end` calls so far
        self._arrivals: deque[JobResult] = deque()  # finished jobs, to apply under the lock
        self._drain_step = 0  # `_step` when the oldest of `_arrivals` arrived
        self._work_queued = False  # between-step work handed to the runtime, not yet done
        self._ticking = False  # the runtime's hook is at work
        self._stuck: set[int] = set()  # jobs that outlived a reset's drain
        self._quarantined: set[int] = set()  # their possible slots, held until they end
        self._fenced: set[int] = set()  # slots held by a fenced reset until `reset_flushed`
        self._fence_until: int | None = None  # or until this many steps (`fence_steps`)
        self._outbox: list[Job] = []  # submitted together at the end of the step
        # The engine's calls read these directly (each is cleared in place, never rebound): a
        # call touches as few objects as it can (BENCHMARKS.md, "The tiering manager on the
        # shared trace": the scheduler-side cost per call).
        self._knows = [(t.tier.knows, t) for t in self.tiers if t.indexed]
        self._checked = bool(self.locator.checked)
        self._known = self.locator.known
        self._queue_check = self.locator.queue_check
        self._request = self.promoter.request
        self._promoting = self.promoter.promoting
        self._refused = self.promoter.refused
        self._late = self.promoter.late
        self._to_check = self.locator.to_check
        self._queued = self.promoter.queued
        self._through = self.demoter.through
        self._tracks_hits = self.history.tracks_hits
        self._tracks_age = self.history.tracks_age
        self._write_through = bool(self.demoter.write_through)
        self._write_back = bool(self.demoter.write_back)
        self._urgency = gil.Urgency()
        """Claimed while promotions or existence checks are in flight (`tiering.gil`): a
        request waits on them while the engine's loop spins."""
        self._checking = self.locator.checking
        self._closed = False  # shut down: the runtime's last ticks claim no urgency
        self._progress = threading.Event()
        """Set whenever finished jobs have been applied (`_drain`): an idle step waits on it."""
        runtime.add_hook(self._on_tick)
        if self.promoter.warm_budget:
            runtime.nudge()  # the warm start begins at the runtime's first tick

    # -- the primary's contract -------------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return self.pool.num_slots

    @property
    def promoting(self) -> AbstractSet[BlockKey]:
        """Keys being promoted (queued this step or in flight)."""
        return self._promoting.keys()

    def promoted_from(self, key: BlockKey) -> Tier | None:
        """The tier `key` is being promoted from (None: it is not being promoted). Inside a
        step, on the scheduler's thread, after a lookup answered PENDING."""
        index = self._promoting.get(key)
        return None if index is None else self.tiers[index].tier

    def lookup(self, key: BlockKey) -> LookupResult:
        if not self.lock.stepping:
            self.lock.begin()
        result = self.pool.lookup(key)
        if result is not _MISS:
            if result is _PENDING:
                if key in self._late:
                    return _MISS  # its promotion is late: recomputing is sooner
                if key in self._warm_keys:  # the engine now waits on a warm start's read
                    self._warm_keys.discard(key)
                    self.promoter.warm_asked = True
            return result
        if not self.tiers:
            return result
        if key in self._promoting:
            return _PENDING  # queued this step, or its slot not allocated yet
        if key in self._refused:
            return _MISS
        unsure = False  # an indexed tier whose store others write cannot say (None)
        for knows, state in self._knows:
            here = knows(key)
            if here:
                return self._request(key, state)
            if here is None:
                unsure = True
        if not (self._checked or unsure):
            return _MISS
        known = self._known.get(key)
        if known is not None and known[1] > self.clock():
            return _MISS if known[0] == ABSENT else self._request(key, self.tiers[known[0]])
        self._queue_check(key)  # submitted at the end of the step
        return _RETRY

    def prepare_store(self, keys: Iterable[BlockKey]) -> StoreGrant | None:
        grant, jobs = self.lock.call(self._prepare_store, keys)
        if jobs:  # demotions of copies (`Demoter.evicted_on_store`): they hold no slot
            self.runtime.submit_many(jobs)
        return grant

    def _prepare_store(self, keys: Iterable[BlockKey]) -> tuple[StoreGrant | None, list[Job]]:
        assert self.lock.owned()
        keys = keys if isinstance(keys, list | tuple) else list(keys)
        grant = self.pool.prepare_store(keys)
        if grant is None:
            self.refusals.refused(keys)
            return None, []
        if grant.evicted:
            if self._write_back:
                self.demoter.evicted_on_store(grant, self._outbox, self._demotion, self._arrived)
            self.history.forget(grant.evicted)
        if self._tracks_age:
            self.history.stored(grant.keys, self.clock())
        jobs, self._outbox = self._outbox, []
        return grant, jobs

    def complete_store(self, keys: Iterable[BlockKey], ok: bool = True) -> None:
        self.lock.call(self._complete_store, list(keys), ok)

    def _complete_store(self, keys: list[BlockKey], ok: bool) -> None:
        assert self.lock.owned()
        self.pool.complete_store(keys, ok=ok)
        if ok and self._write_through:
            self.demoter.stored(keys)  # pinned and demoted by the runtime, between steps

    def prepare_load(self, keys: Sequence[BlockKey]) -> list[int]:
        if not self.lock.stepping:
            self.lock.begin()
        slots = self.pool.prepare_load(keys)
        if self._tracks_hits:
            self.history.loaded(keys)
        return slots

    def complete_load(self, keys: Iterable[BlockKey]) -> None:
        self.lock.call(self.pool.complete_load, keys)

    def touch(self, keys: Iterable[BlockKey]) -> None:
        self.lock.call(self.pool.touch, keys)

    def reset(
        self, drain_timeout: float = 30.0, *, fence: bool = False, fence_steps: int | None = None
    ) -> None:
        """Wait for in-flight jobs (they may be writing or reading primary slots), then forget
        the primary and every job; the tiers keep their blocks. vLLM calls this between steps,
        never in one, so the wait (bounded by the jobs' deadlines) is allowed here.

        `fence`: the engine's own copies in flight at the reset (stores into slots, loads out
        of them) may still run; every slot in use stays out of the free list until
        `reset_flushed` says they have all ended (vLLM 0.33's `on_reset_flushed`), or, with
        `fence_steps`, until that many steps have ended (`on_schedule_end`) when the engine
        never says (vLLM 0.32: it runs and waits for the copies in flight at a reset in the
        next step, so they have ended once the steps that can be in flight meanwhile have)."""
        self.lock.end()  # the runtime applies what finishes meanwhile
        with self.lock.held():
            self.promoter.end_warm("reset")  # no batch after the one in flight: drained below
        deadline = self.clock() + drain_timeout
        while self.runtime.pending() and self.clock() < deadline:
            time.sleep(0.001)
        self.runtime.poll()
        with self.lock.held():
            # Apply what ended first: a finished job's slots are then no longer in use, and
            # only those of the engine's copies and of jobs that did not end are held below.
            self._drain()
            stuck = self.runtime.pending_ids()
            keep: set[int] = set()
            if stuck:  # jobs that did not end (a hung disk): their slots stay out of use
                keep = self.pool.slots_in_use() | self._quarantined
                self.counters["reset_slots_quarantined"] += len(keep - self._quarantined)
                self._stuck |= stuck
            self._quarantined = keep
            if fence:
                fenced = self.pool.slots_in_use()
                self.counters["reset_slots_fenced"] += len(fenced - self._fenced)
                self._fenced = fenced
                self._fence_until = None if fence_steps is None else self._step + fence_steps
            self._generation += 1
            self.pool.reset(keep | self._fenced)
            self._arrivals.clear()
            self._work_queued = False
            self._outbox.clear()
            self.locator.clear()
            self.promoter.clear()
            self.demoter.clear()
            self.history.clear()
            self._urgency.set(False)

    def reset_flushed(self) -> None:
        """The engine's copies in flight at the last fenced `reset` have all ended: the slots
        they could touch go back to the free list (those a stuck tier job may still use stay
        held until it ends)."""
        self.lock.call(self._reset_flushed)

    def _reset_flushed(self) -> None:
        assert self.lock.owned()
        if self._fenced:
            self.pool.release(self._fenced - self._quarantined)
            self._fenced = set()
        self._fence_until = None

    def take_events(self) -> list[PrimaryEvent | TierEvent]:
        return self.lock.call(self._take_events)

    def _take_events(self) -> list[PrimaryEvent | TierEvent]:
        assert self.lock.owned()
        events: list[PrimaryEvent | TierEvent] = list(self.pool.take_events())
        events += self.demoter.take_events()
        if self.pool.events:
            failed = self.promoter.take_failed()
            if failed:  # see `PrimaryEvent.metadata_only`
                events.append(PrimaryEvent(tuple(failed), removed=True, metadata_only=True))
        return events

    def has_pending_work(self) -> bool:
        """Work the engine must keep stepping for (vLLM steps while this holds). A warm
        start's batch is not, until a request waits on one of its blocks: the runtime applies
        its result."""
        return bool(
            self.runtime.pending() > self.promoter.warm_unasked()
            or self._arrivals
            or self._work_queued
            or self._ticking
            or self._to_check
            or self._outbox
            or self._through
            or self.promoter.pending()
        )

    def on_schedule_end(self, idle: bool = False) -> None:
        """Once per engine step, after its lookups and loads: hand the step's existence checks,
        promotions and write-through demotions to the runtime, which submits them and reclaims
        for write-back demotions between steps (or do it here, when the runtime missed the last
        window).

        `idle`: the step schedules nothing. While promotions or checks are in flight, the
        engine then only waits for them, running empty steps back to back; instead this call
        waits (up to `IDLE_WAIT`, the GIL released) until one of them has been applied, so the
        threads doing the work are not starved and the next step sees the result."""
        lock = self.lock
        if not lock.stepping:
            lock.begin()
        jobs: list[Job] = []
        nudge = False
        wait = False
        try:
            self._step += 1
            self._refused.clear()
            if self._fence_until is not None and self._step >= self._fence_until:
                self._reset_flushed()  # the copies in flight at the last reset have ended
            late = self._work_queued  # queued at the last step's end, and not done since
            late_drain = self._arrivals and self._drain_step < self._step - 1
            if late or late_drain:  # the runtime did not get the lock between two steps
                self.counters["bookkeeping_on_scheduler"] += 1
                self._between()
                jobs, self._outbox = self._outbox, []
            elif not self._work_queued and self._between_due():
                self._work_queued = nudge = True
            if self._publish is not None:
                self._publish(self._snapshot())
            urgent = self._urgent()
            self._urgency.set(urgent)
            if idle and (urgent or self.promoter.warming):
                wait = True
                self.counters["idle_waits"] += 1
                self._progress.clear()  # under the lock: no result is applied meanwhile
        finally:
            lock.end()
        if jobs:
            self.runtime.submit_many(jobs)
        if nudge:
            self.runtime.nudge()
        if wait:
            self._progress.wait(IDLE_WAIT)

    def quiet(self) -> AbstractContextManager[None]:
        """Hold the runtime's bookkeeping still (for a consistent look at the state)."""
        return self.lock.held()

    def where(self, key: BlockKey) -> str | None:
        """The first tier known to hold `key`, by name (None: none known)."""
        return self.lock.call(self._where_is, key)

    def _where_is(self, key: BlockKey) -> str | None:
        assert self.lock.owned()
        state = self.locator.where(key)
        return None if state is None else state.config.name

    def stats(self) -> dict[str, Any]:
        """Counters per tier and of the manager, breaker states, and the latency samples since
        the last call (for histograms)."""
        return self.lock.call(self._stats)

    def _stats(self) -> dict[str, Any]:
        assert self.lock.owned()
        return StatsSnapshot.take(
            self.pool, self.tiers, self.counters, self.runtime, latencies=True, usage=self.usage
        ).as_dict()

    def snapshot(self) -> dict[str, Any]:
        """Counters and gauges as plain numbers (no latency samples: `stats` drains those)."""
        return self.lock.call(self._snapshot)

    def _snapshot(self) -> dict[str, Any]:
        assert self.lock.owned()
        return StatsSnapshot.take(
            self.pool, self.tiers, self.counters, self.runtime, latencies=False, usage=self.usage
        ).as_dict()

    def shutdown(self, timeout: float = 5.0, flush: float | None = None) -> None:
        """For as long as `flush` seconds allow (`shutdown.flush` when None), write what the
        write-through tiers were still to get and (`shutdown.resident`) the blocks still
        resident to the write-back tiers that outlive the engine (disk and remote media;
        newest first), waiting for the tier jobs in flight (their slots are still mapped:
        nothing is cut off in the middle); then close the tiers (each within `timeout`) and
        the runtime.

        The blocks an engine stored in its last steps are queued for the write-through tiers
        between steps; an engine that stops right after its last request (vLLM's offline `LLM`)
        runs no step more, and those blocks were lost to the next engine on the same tiers. A
        write-back tier gets a block when the primary evicts it: without the flush, what the
        primary held at the end (the most recent blocks) was lost to the next engine."""
        self.lock.end()
        if self._closed:  # a second call: the tiers and the runtime are closed already
            return
        self.usage.close()
        with self.lock.held():
            self.promoter.end_warm("shutdown")  # the flush's writes have the medium to themselves
        try:
            self._flush(self.config.shutdown.flush if flush is None else flush)
        except StateError:  # the runtime was shut down already: nothing more can be written
            self.counters["close_errors"] += 1
        with self.lock.held():  # serialized with `_on_tick`, which claims under the lock
            self._closed = True
            self._urgency.set(False)
        for state in self.tiers:
            try:
                self.runtime.run_sync(state.tier.close, timeout)
            except Exception:  # closing must not stop the rest from closing
                self.counters["close_errors"] += 1
        self.runtime.shutdown()

    def _urgent(self) -> bool:
        """Promotions or existence checks the engine waits on are in flight (a late promotion's
        key reads MISS: the engine recomputes it and waits on nothing; `late` is a subset of
        `promoting`; so is a warm start's batch, whose keys no lookup asked for are in
        `warm_keys`, disjoint from `late`). Under the lock."""
        if self._closed:
            return False
        waited = len(self._promoting) - len(self._late) - len(self._warm_keys)
        return waited > 0 or bool(self._checking)

    def _flush(self, timeout: float) -> None:
        """Submit the queued demotions, then the resident blocks to the write-back tiers that
        outlive the engine (unless `shutdown.resident` is off), in rounds of each tier's
        `max_inflight`, until none is left or `timeout` has passed; wait for the jobs in flight
        until then. A `timeout` of 0 submits nothing."""
        if timeout <= 0:
            return
        deadline = time.monotonic() + timeout  # (not `clock`: a test's may stand still)
        demoter = self.demoter
        with self.lock.held():
            self._drain()
            demoter.demote_through(self._outbox, self._demotion, self._arrived)
            flush = demoter.resident_flush(self.config.shutdown.resident)
            demoter.demote_resident(flush, self._outbox, self._demotion, self._arrived)
            jobs, self._outbox = self._outbox, []
        while True:
            if jobs:
                self.runtime.submit_many(jobs)
            while self.runtime.pending() and time.monotonic() < deadline:
                time.sleep(0.005)
            with self.lock.held():
                self._drain()
                if not (demoter.flush_left(flush) and time.monotonic() < deadline):
                    return
                demoter.demote_resident(flush, self._outbox, self._demotion, self._arrived)
                jobs, self._outbox = self._outbox, []

    # -- the runtime's side ----------------------------------------------------------------------

    def _check(self, index: int, keys: list[BlockKey]) -> ExistenceCheck:
        return ExistenceCheck(self._generation, index, keys)

    def _promotion(
        self, index: int, batch: list[tuple[BlockKey, int]], warm: bool = False
    ) -> Promotion:
        return Promotion(self._generation, index, batch, warm)

    def _demotion(
        self, index: int, keys: list[BlockKey], slots: list[int], hold: SlotHold
    ) -> Demotion:
        return Demotion(self._generation, index, keys, slots, hold)

    def _between_due(self) -> bool:
        """Whether the runtime has between-step work (checked under the lock)."""
        if self._to_check or self._queued or self._through:
            return True
        return self._write_back and self.demoter.due()

    def _on_tick(self) -> bool:
        """The runtime's hook, on its thread at every tick: apply finished jobs, mark late
        promotions, and do the between-step work once a step has handed it over. Never waits
        for the lock: if the scheduler holds it, next tick. Whether it did or has work."""
        if not (
            self._arrivals
            or self._work_queued
            or self.promoter.overdue()
            or self._stuck
            or self.promoter.warm_due()
        ):
            return False
        assert self.runtime.on_loop_thread(), "the runtime's hook called off its thread"
        if not self.lock.try_acquire():
            return True
        self._ticking = True  # pending work, for `has_pending_work` on other threads
        try:
            start, cpu = time.perf_counter(), time.thread_time()
            if self._work_queued:
                self._between()
            else:
                self._drain()
            if self.promoter.warm_due() and not self._closed:
                self._warm()
            if self._stuck and self._stuck.isdisjoint(self.runtime.pending_ids()):
                # the jobs a reset outlived have ended (a fence may hold some slots longer)
                self.pool.release(self._quarantined - self._fenced)
                self._stuck, self._quarantined = set(), set()
            jobs, self._outbox = self._outbox, []
            if jobs:
                self.runtime.submit_from_loop(jobs)
            self._urgency.set(self._urgent())
            self.counters["bookkeeping_seconds"] += time.perf_counter() - start
            self.counters["bookkeeping_cpu_seconds"] += time.thread_time() - cpu
        finally:
            self._ticking = False
            self.lock.release()
        return True

    def _warm(self) -> None:
        """Submit the warm start's next batch into free slots above the write-back reserve
        (a warmed block that took the reserve would be demoted again at once)."""
        assert self.lock.owned()
        reserve = self.demoter.reserve if self._write_back else 0
        self.promoter.submit_warm(
            self._outbox,
            self._promotion,
            self._arrived,
            room=self.pool.num_free - reserve,
            block_bytes=self._block_bytes,
        )

    def _between(self) -> None:
        """Apply finished jobs, submit the queued checks, write-through demotions and
        promotions (allocating their slots), and reclaim for write-back demotions. Between two
        steps only: allocating and reclaiming evict blocks."""
        assert self.lock.owned()
        self._work_queued = False
        self._drain()
        outbox, done = self._outbox, self._arrived
        self.locator.submit_checks(outbox, self._check, done, self.config.faults.timeout)
        self.demoter.demote_through(outbox, self._demotion, done)
        self.promoter.submit(outbox, self._promotion, done)
        self.demoter.reclaim(outbox, self._demotion, done)

    def _arrived(self, result: JobResult) -> None:
        """A job's `done` handler, on the runtime's thread (or the submitter's, for a job an
        open breaker refused): queued without the lock, applied under it at the next tick
        (`_on_tick`) or by the next step's end."""
        if not self._arrivals:
            self._drain_step = self._step
        self._arrivals.append(result)

    def _drain(self) -> None:
        """Apply the finished jobs, and mark promotions past their deadline late."""
        assert self.lock.owned()
        late = self.promoter.mark_late(self.clock())
        arrivals = self._arrivals
        if arrivals or late:  # a late key reads MISS: the waiting request may recompute now
            self._progress.set()  # (seen once the lock is released, after these are applied)
        while arrivals:
            result = arrivals.popleft()
            job: TierJob = result.tag
            if job.generation != self._generation:
                continue  # from before a reset
            state = self.tiers[job.tier]
            if result.ok and result.fault is None:
                state.latencies.append(result.seconds)
            else:  # failed, refused, or a batch that faulted (`JobResult.fault`)
                state.counters["errors"] += 1
            match job:
                case ExistenceCheck(keys=keys):
                    present = answers(result, len(keys), False)
                    self.locator.answered(state, keys, present, self.clock())
                case Promotion():
                    self.promoter.promoted(state, job, result)
                case Demotion():
                    self.demoter.demoted(state, job, result)
