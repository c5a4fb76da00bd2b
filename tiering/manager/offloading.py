"""`TieringOffloadingManager`: the CPU primary pool plus secondary tiers.

Scheduler process: called on the scheduler's thread, with its bookkeeping on the runtime's
(**Threads**, below). It serves the primary pool's contract (so the vLLM adapter serves it
unchanged) and moves blocks between the primary and the tiers on the runtime, never waiting on
I/O. It is a facade over one object per concept, built and wired by `wiring.wire`:

- `StepLock` (`steplock`): the lock the scheduler holds for a step;
- `TierLocator` (`locator`): where each block is known to be, with its TTLs, and the batched
  existence checks of the tiers without an index;
- `Promoter` (`promotion`): promotions queued and in flight, late and refused ones;
- `WarmStart` (`warm`): a restarted engine's primary filled from its tiers, following the
  last run's manifest of use (`manifest`), which `ManifestRecorder` (`recorder`) writes;
- `Demoter` (`demotion`): the three write modes, reclaim, back-pressure and the shutdown's
  flush;
- `JobSink` (`jobs`): the one outbox the locator, the promoter and the demoter put their jobs
  in (stamped with the generation and the done handler), and the job records;
- `Bookkeeping` (`bookkeeping`): the runtime's side: finished jobs applied, between-step work,
  the tick hook;
- `ResetFences` (`fences`): a reset, with the slots its fences and quarantine hold;
- placement policies (`tiering.placement`): the tiers' admission and the promotion gate;
- `StoreRefusals` (`refusals`), `StatsSnapshot` (`stats`), and `UsagePoller` (`usage`: the
  tiers' store-wide usage, polled apart from the jobs).

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
the rest (`Bookkeeping`), under the step lock (`lock`): it applies finished jobs (promoted
blocks become ready, demoted blocks' slots are given back) and, between steps, submits the
existence checks and promotions the step queued (allocating their slots), pins write-through
blocks and reclaims slots for write-back demotions. In vLLM that work runs while the model does,
not in the scheduler's step. The scheduler holds the lock from a step's first `lookup` to
`on_schedule_end` (one acquisition per step, not one per call), so a block looked up as HIT is
never reclaimed or evicted before the same step's `prepare_load`; other calls take it one at a
time. The runtime never waits for the lock: it tries, and tries again a tick later. If it missed
a whole window between two steps, `on_schedule_end` does the work itself. Every method that
touches shared state asserts that its thread holds the lock (`StepLock.owned`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from contextlib import AbstractContextManager
from typing import Any

from tiering.config import Config, TierConfig
from tiering.errors import StateError
from tiering.keys import BlockKey
from tiering.manager.counters import (
    CLOSE_ERRORS,
    STORE_COMPLETIONS_IGNORED,
    STORES_FAILED,
    TRACE_DROPPED,
    TRACE_FAILED,
    TRACE_WRITTEN,
)
from tiering.manager.locator import ASKING
from tiering.manager.stats import StatsSnapshot
from tiering.manager.tierstate import TierEvent
from tiering.manager.traffic import MISS, PRIMARY, TrafficRecorder
from tiering.manager.wiring import wire
from tiering.placement import PromotionGate
from tiering.primary import KeyState, LookupResult, PrimaryEvent, PrimaryPool, StoreGrant
from tiering.runtime import Job, Runtime
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

    __slots__ = (
        "_publish",
        "_write_through",
        "bookkeeping",
        "clock",
        "config",
        "counters",
        "demoter",
        "fences",
        "history",
        "locator",
        "lock",
        "pool",
        "promoter",
        "recorder",
        "refusals",
        "runtime",
        "sink",
        "tiers",
        "traffic",
        "usage",
        "warm",
    )

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
        the end of every step, under the lock (it must not block). The collaborators are
        built and wired by `tiering.manager.wiring.wire`."""
        parts = wire(
            pool,
            tiers,
            slot_view,
            config=config,
            runtime=runtime,
            block_tokens=block_tokens,
            reserve=reserve,
            max_inflight=max_inflight,
            clock=clock,
            gate=gate,
        )
        self.pool, self.tiers, self.config, self.runtime = pool, parts.tiers, config, runtime
        self.clock, self.counters, self.lock = clock, parts.counters, parts.lock
        self.history, self.sink, self.locator = parts.history, parts.sink, parts.locator
        self.demoter, self.promoter, self.warm = parts.demoter, parts.promoter, parts.warm
        self.fences, self.bookkeeping = parts.fences, parts.bookkeeping
        self.refusals, self.usage, self.recorder = parts.refusals, parts.usage, parts.recorder
        self._publish = publish
        self.traffic = (
            TrafficRecorder(config.trace, block_tokens, clock=clock)
            if config.trace.record is not None
            else None
        )
        """The lookup stream's recorder (`trace.record`; None: off)."""
        self._write_through = bool(self.demoter.write_through)
        """Some tier is written through: a completed store is queued for it."""
        runtime.add_hook(self.bookkeeping.on_tick)
        if self.warm.budget:
            runtime.nudge()  # the warm start begins at the runtime's first tick

    # -- the primary's contract -------------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return self.pool.num_slots

    @property
    def promoting(self) -> AbstractSet[BlockKey]:
        """Keys being promoted (queued this step or in flight)."""
        return self.promoter.promoting.keys()

    def promoted_from(self, key: BlockKey) -> Tier | None:
        """The tier `key` is being promoted from (None: it is not being promoted). Inside a
        step, on the scheduler's thread, after a lookup answered PENDING."""
        index = self.promoter.promoting.get(key)
        return None if index is None else self.tiers[index].tier

    def lookup(self, key: BlockKey) -> LookupResult:
        if self.traffic is not None:
            return self._recorded_lookup(key, self.traffic)
        return self._lookup(key)

    def _recorded_lookup(self, key: BlockKey, traffic: TrafficRecorder) -> LookupResult:
        result, where = self.lookup_where(key)
        if where is not None:
            traffic.answer(key, where)
        return result

    def lookup_where(self, key: BlockKey) -> tuple[LookupResult, str | None]:
        """`lookup`, and where it found `key` (`primary`, the tier it is promoted from,
        `miss`; None for RETRY: not found yet), noted nowhere: for a caller that keeps the
        answers per request itself (`record(found=...)`)."""
        result = self._lookup(key)
        if result is _HIT:
            return result, PRIMARY
        if result is _MISS:
            return result, MISS
        if result is _PENDING:
            index = self.promoter.promoting.get(key)
            return result, PRIMARY if index is None else self.tiers[index].config.name
        return result, None

    def record(
        self,
        keys: Collection[BlockKey],
        *,
        tokens: int | None = None,
        engine_blocks: int = 0,
        found: Mapping[BlockKey, str | None] | None = None,
    ) -> None:
        """A request whose block keys (prompt order) were looked up, once admitted: recorded
        (`trace.record`) with where the lookups found each block; nothing when not recording.
        `tokens`: its prompt's, where known; `engine_blocks`: its leading blocks the engine's
        own cache had (never looked up, so not in `keys`); `found`: where each key was found,
        the request's own answers (`lookup_where`; a key absent or None: a miss), handed over
        (not copied; the caller lets go of it); None: the answers `lookup` noted since the
        last request was recorded. Scheduler's thread; never waits."""
        if self.traffic is not None:
            self.traffic.record(keys, tokens=tokens, engine_blocks=engine_blocks, found=found)

    def _lookup(self, key: BlockKey) -> LookupResult:
        if not self.lock.stepping:
            self.lock.begin()
        result = self.pool.lookup(key)
        if result is not _MISS:
            if result is _PENDING:
                if key in self.promoter.late:
                    return _MISS  # its promotion is late: recomputing is sooner
                if key in self.warm.keys:  # the engine now waits on a warm start's read
                    self.warm.ask(key)
            return result
        if not self.tiers:
            return result
        promoter = self.promoter
        if key in promoter.promoting:
            return _PENDING  # queued this step, or its slot not allocated yet
        if key in promoter.refused:
            return _MISS
        where = self.locator.find(key)
        if where is None:
            return _MISS
        if where is ASKING:
            return _RETRY  # looked for at the end of the step
        return promoter.request(key, where)

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
        history = self.history
        if grant.evicted:
            if self.demoter.write_back:
                self.demoter.evicted_on_store(grant)
            history.forget(grant.evicted)
        if history.tracks_age:
            history.stored(grant.keys, self.clock())
        return grant, self.sink.take()

    def complete_store(self, keys: Iterable[BlockKey], ok: bool = True) -> None:
        keys = keys if isinstance(keys, list | tuple) else list(keys)
        self.lock.call(self._complete_store, keys, ok)

    def _complete_store(self, keys: Sequence[BlockKey], ok: bool) -> None:
        """The engine's store of `keys` ended: READY, or on failure dropped and their slots
        freed (nothing half-written is ever served). A key the engine is not writing (not
        resident, ready, or being promoted) is ignored and counted, as vLLM's interface says:
        after a cache reset or a store that overlapped a promotion, the engine may complete
        keys the primary no longer holds for it."""
        assert self.lock.owned()
        pool, promoter = self.pool, self.promoter
        mine = [
            key
            for key in dict.fromkeys(keys)
            if pool.state(key) is KeyState.WRITING
            and key not in promoter.promoting
            and key not in promoter.late
        ]
        if len(mine) < len(keys):
            self.counters[STORE_COMPLETIONS_IGNORED] += len(keys) - len(mine)
        if not ok:
            self.counters[STORES_FAILED] += len(mine)
        pool.complete_store(mine, ok=ok)
        if ok and self._write_through:
            self.demoter.stored(mine)  # pinned and demoted by the runtime, between steps

    def prepare_load(self, keys: Sequence[BlockKey]) -> list[int]:
        if not self.lock.stepping:
            self.lock.begin()
        slots = self.pool.prepare_load(keys)
        if self.history.tracks_hits:
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

        `fence`: the engine's own copies in flight at the reset may still run: every slot in
        use stays out of the free list until `reset_flushed`, or, with `fence_steps`, until
        that many steps have ended (`fences`)."""
        self.lock.end()  # the runtime applies what finishes meanwhile
        with self.lock.held():
            self.warm.end("reset")  # no batch after the one in flight: drained below
        bookkeeping = self.bookkeeping
        self.fences.reset(
            drain_timeout,
            fence=fence,
            fence_steps=fence_steps,
            step=bookkeeping.arrivals.step,
            drain=bookkeeping.drain,
            forget=bookkeeping.forget,
        )

    def reset_flushed(self) -> None:
        """The engine's copies in flight at the last fenced `reset` have all ended: the slots
        they could touch go back to the free list (those a stuck tier job may still use stay
        held until it ends)."""
        self.lock.call(self.fences.flushed)

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
        """Work the engine must keep stepping for (vLLM steps while this holds;
        `Bookkeeping.pending`)."""
        return self.bookkeeping.pending()

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
        bookkeeping = self.bookkeeping
        try:
            jobs, nudge = bookkeeping.step_end()
            if self._publish is not None:
                self._publish(self._snapshot())
            wait = bookkeeping.idle_wait(idle)
        finally:
            lock.end()
        if jobs:
            self.runtime.submit_many(jobs)
        if nudge:
            self.runtime.nudge()
        if wait:
            bookkeeping.progress.wait(IDLE_WAIT)

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
        self._count_traffic()
        return StatsSnapshot.take(
            self.pool, self.tiers, self.counters, self.runtime, latencies=True, usage=self.usage
        ).as_dict()

    def snapshot(self) -> dict[str, Any]:
        """Counters and gauges as plain numbers (no latency samples: `stats` drains those)."""
        return self.lock.call(self._snapshot)

    def _snapshot(self) -> dict[str, Any]:
        assert self.lock.owned()
        self._count_traffic()
        return StatsSnapshot.take(
            self.pool, self.tiers, self.counters, self.runtime, latencies=False, usage=self.usage
        ).as_dict()

    def _count_traffic(self) -> None:
        traffic = self.traffic
        if traffic is not None:
            counters = self.counters
            counters[TRACE_WRITTEN] = traffic.written
            counters[TRACE_DROPPED] = traffic.dropped
            counters[TRACE_FAILED] = traffic.failed

    def shutdown(self, flush: float | None = None) -> None:
        """For as long as `flush` seconds allow (`shutdown.flush` when None), write what the
        write-through tiers were still to get and (`shutdown.resident`) the blocks still
        resident to the write-back tiers that outlive the engine (disk and remote media;
        newest first), waiting for the tier jobs in flight (their slots are still mapped:
        nothing is cut off in the middle: `Demoter.flush`); then stop: no job more, the hook
        off the runtime. The tiers and the runtime stay open: whoever opened them closes them
        (`tiering.manager.close_tiers`, `Runtime.shutdown`), after this.

        The blocks an engine stored in its last steps are queued for the write-through tiers
        between steps; an engine that stops right after its last request (vLLM's offline `LLM`)
        runs no step more, and those blocks were lost to the next engine on the same tiers. A
        write-back tier gets a block when the primary evicts it: without the flush, what the
        primary held at the end (the most recent blocks) was lost to the next engine."""
        self.lock.end()
        bookkeeping = self.bookkeeping
        if bookkeeping.closed:  # a second call: stopped already
            return
        self.usage.close()
        with self.lock.held():
            self.warm.end("shutdown")  # the flush's writes have the medium to themselves
        shutdown = self.config.shutdown
        try:
            self.demoter.flush(
                shutdown.flush if flush is None else flush,
                resident=shutdown.resident,
                runtime=self.runtime,
                lock=self.lock,
                drain=bookkeeping.drain,
            )
        except StateError:  # the runtime was shut down already: nothing more can be written
            self.counters[CLOSE_ERRORS] += 1
        if self.recorder is not None:  # after the flush: the blocks it names are stored first
            self.recorder.final(max(1.0, shutdown.flush if flush is None else flush))
        with self.lock.held():  # serialized with `on_tick`, which claims under the lock
            bookkeeping.closed = True
            bookkeeping.urgency.set(False)
        self.runtime.remove_hook(bookkeeping.on_tick)
        if self.traffic is not None:  # what the last requests queued is written
            self.traffic.close()
