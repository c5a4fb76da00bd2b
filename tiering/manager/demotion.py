"""Demotions: primary -> secondary tier, by each tier's write mode.

- `through`: a block is demoted when its store completes. The stored keys are queued
  (`stored`); between steps the ones still resident are pinned (`pin_for_demotion`) and
  written to each write-through tier that does not hold them yet; the job's end unpins them.
- `back` and `selective`: background reclaim (`reclaim`) keeps `reserve` slots free or held:
  it takes blocks from the eviction policy's end (`PrimaryPool.reclaim`: they leave the
  primary, their slots are held while a tier reads them) and demotes those each tier admits
  (not held there already, then its admission policies: `selective`'s hits, `min_age`). A
  slot goes back to the free list when the last demotion reading it ends.
- At shutdown (`flush`: the loop of rounds; `demote_resident`: one round), the blocks still
  resident go to the write-back tiers that outlive the engine (disk and remote media), newest
  first, as many as the flush's time allows: they would otherwise reach such a tier only on an
  eviction that never comes.
- A block evicted on the store path itself (no slot was reserved in time) has its bytes in a
  slot that now belongs to a new block: they are copied out at once and the copies demoted
  (`evicted_on_store`).

Back-pressure: at most `max_inflight` blocks per tier are in flight; beyond that, demotions are
dropped and counted (`demotions_dropped`): a slow tier never blocks the primary.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tiering.errors import TierError
from tiering.keys import BlockKey
from tiering.manager.counters import (
    BYTES_DEMOTED,
    DEMOTION_FAILURES,
    DEMOTIONS,
    DEMOTIONS_DROPPED,
    DEMOTIONS_SKIPPED,
    DIRECT_EVICTIONS,
)
from tiering.manager.jobs import Demotion, JobSink, SlotHold, answers, put_from
from tiering.manager.locator import TierLocator, known_at
from tiering.manager.steplock import StepLock
from tiering.manager.tierstate import TierEvent, TierState
from tiering.placement import BlockHistory
from tiering.primary import LookupResult, PrimaryPool, StoreGrant
from tiering.runtime import JobResult, Runtime

__all__ = ["Demoter", "ResidentFlush"]

_HIT = LookupResult.HIT


@dataclass
class ResidentFlush:
    """A shutdown's demotion of the resident blocks: the keys, newest first, and per tier
    (by index) how many of them it has been through."""

    keys: list[BlockKey]
    sent: dict[int, int] = field(default_factory=dict)


class Demoter:
    """The demotions of every tier. Scheduler process, under the step lock (scheduler or
    runtime thread): `stored` and `evicted_on_store` on the store path, the rest between
    steps."""

    __slots__ = (
        "_held",
        "clock",
        "counters",
        "events",
        "history",
        "locator",
        "max_inflight",
        "outliving",
        "pool",
        "reserve",
        "sink",
        "slot_view",
        "through",
        "tiers",
        "timeout",
        "write_back",
        "write_through",
    )

    def __init__(
        self,
        pool: PrimaryPool,
        tiers: Sequence[TierState],
        locator: TierLocator,
        history: BlockHistory,
        sink: JobSink,
        *,
        slot_view: Callable[[int], memoryview],
        timeout: float,
        reserve: int,
        max_inflight: int,
        counters: defaultdict[str, float],
        clock: Callable[[], float],
    ) -> None:
        self.pool = pool
        self.tiers = list(tiers)
        self.locator = locator
        self.history = history
        self.sink = sink
        self.slot_view = slot_view
        self.timeout = timeout
        """Seconds per block a demotion job may take (`faults.timeout`)."""
        self.reserve = reserve
        self.max_inflight = max_inflight
        self.counters = counters
        self.clock = clock
        self.write_through = [t for t in self.tiers if t.config.write == "through"]
        self.write_back = [t for t in self.tiers if t.config.write != "through"]
        self.outliving = [t for t in self.write_back if t.tier.medium != "memory"]
        """The write-back tiers that outlive the engine (disk, remote): a shutdown's flush."""
        self.through: list[BlockKey] = []
        """Stored blocks for the write-through tiers, pinned and demoted between steps."""
        self._held: dict[int, int] = {}
        """Reclaimed slot -> demotions still reading it."""
        self.events: list[TierEvent] = []

    def stored(self, keys: Sequence[BlockKey]) -> None:
        """The engine's store of `keys` completed."""
        if self.write_through:
            self.through += keys

    def due(self) -> bool:
        """Whether there is demotion work between steps (under the lock)."""
        pool = self.pool
        return bool(
            self.through or (self.write_back and pool.num_free + pool.num_held < self.reserve)
        )

    def demote_through(self) -> None:
        """Pin the blocks stored since the last time and demote them to the write-through
        tiers. One evicted meanwhile (it was not pinned yet) is dropped and counted."""
        if not self.through:
            return
        lookup = self.pool.lookup
        queued = dict.fromkeys(self.through)
        self.through.clear()  # cleared in place: the manager reads it directly
        stored = [key for key in queued if lookup(key) is _HIT]
        if len(stored) < len(queued):
            for state in self.write_through:
                state.counters[DEMOTIONS_DROPPED] += len(queued) - len(stored)
        now = self.clock()
        for state in self.write_through:
            keys = [key for key in stored if not self.locator.holds(state, key, now)]
            if not keys:
                continue
            room = self.max_inflight - state.inflight
            if room <= 0:
                state.counters[DEMOTIONS_DROPPED] += len(keys)
                continue
            batch = keys[:room]
            state.counters[DEMOTIONS_DROPPED] += len(keys) - len(batch)
            slots = self.pool.pin_for_demotion(batch)  # released when the tier has them
            self._submit(state, batch, slots, SlotHold.PINNED)

    def reclaim(self) -> None:
        """Take blocks from the policy's end until `reserve` slots are free or held, and
        demote each to the write-back tiers that admit it."""
        if not self.write_back:
            return
        pool = self.pool
        need = self.reserve - pool.num_free - pool.num_held
        room = min(self.max_inflight - t.inflight for t in self.write_back)
        n = min(need, room)
        if n <= 0:
            return
        victims = pool.reclaim(n)
        if not victims:
            return
        now = self.clock()
        held = self._held
        for state in self.write_back:
            chosen = self.admit(state, victims, now)
            if chosen:
                slots = [s for _, s in chosen]
                for slot in slots:
                    held[slot] = held.get(slot, 0) + 1
                self._submit(state, [k for k, _ in chosen], slots, SlotHold.HELD)
        self.history.forget(key for key, _ in victims)
        release = [slot for _, slot in victims if slot not in held]
        if release:
            pool.release(release)

    def resident_flush(self, resident: bool = True) -> ResidentFlush:
        """What a shutdown sends to the write-back tiers: the resident blocks, newest first
        (none without `resident`: `shutdown.resident`)."""
        return ResidentFlush(self.pool.ready_keys() if resident else [])

    def demote_resident(self, flush: ResidentFlush) -> None:
        """At shutdown: pin the next of `flush`'s blocks still resident, as many as each
        write-back tier whose medium outlives the engine (not memory) has room for
        (`max_inflight`), and demote those it admits. Each call goes on where the last one
        ended, so a failed block is not sent again."""
        lookup = self.pool.lookup
        now = self.clock()
        for state in self.outliving:
            room = self.max_inflight - state.inflight
            start = flush.sent.get(state.index, 0)
            if room <= 0 or start >= len(flush.keys):
                continue
            window = flush.keys[start : start + room]
            flush.sent[state.index] = start + len(window)
            blocks = [(key, 0) for key in window if lookup(key) is _HIT]
            batch = [key for key, _ in self.admit(state, blocks, now)]
            if batch:
                slots = self.pool.pin_for_demotion(batch)  # released when the tier has them
                self._submit(state, batch, slots, SlotHold.PINNED)

    def flush_left(self, flush: ResidentFlush) -> bool:
        """Whether a write-back tier that outlives the engine has blocks of `flush` to go."""
        return any(flush.sent.get(state.index, 0) < len(flush.keys) for state in self.outliving)

    def flush(
        self,
        timeout: float,
        *,
        resident: bool,
        runtime: Runtime,
        lock: StepLock,
        drain: Callable[[], None],
    ) -> None:
        """At shutdown, off the runtime's thread: submit the queued write-through demotions,
        then the resident blocks to the write-back tiers that outlive the engine (unless
        `resident` is off: `shutdown.resident`), in rounds of each tier's `max_inflight`, until
        none is left or `timeout` has passed; wait for the jobs in flight until then, applying
        their results (`drain`, under `lock`). A `timeout` of 0 submits nothing."""
        if timeout <= 0:
            return
        deadline = time.monotonic() + timeout  # (not `clock`: a test's may stand still)
        with lock.held():
            drain()
            self.demote_through()
            flush = self.resident_flush(resident)
            self.demote_resident(flush)
            jobs = self.sink.take()
        while True:
            if jobs:
                runtime.submit_many(jobs)
            while runtime.pending() and time.monotonic() < deadline:
                time.sleep(0.005)
            with lock.held():
                drain()
                if not (self.flush_left(flush) and time.monotonic() < deadline):
                    return
                self.demote_resident(flush)
                jobs = self.sink.take()

    def evicted_on_store(self, grant: StoreGrant) -> None:
        """Blocks evicted on the store path, whose slots now belong to new blocks: their bytes
        stay there until the engine's copy runs (a later step), so copy them out now and demote
        the copies. A memcpy per block on the scheduler's thread: background reclaim keeps
        these rare, and `max_inflight` bounds them (beyond it they are dropped and counted)."""
        self.counters[DIRECT_EVICTIONS] += len(grant.evicted)
        now = self.clock()
        copies: dict[int, bytes] = {}
        for state in self.write_back:
            room = self.max_inflight - state.inflight
            chosen: list[tuple[BlockKey, bytes]] = []
            evicted = list(zip(grant.evicted, grant.evicted_slots, strict=True))
            for key, slot in self.admit(state, evicted, now):
                if len(chosen) >= room:
                    state.counters[DEMOTIONS_DROPPED] += 1
                    continue
                if slot not in copies:
                    copies[slot] = bytes(self.slot_view(slot))
                chosen.append((key, copies[slot]))
            if chosen:
                state.inflight += len(chosen)
                self.sink.demotion(
                    state,
                    functools.partial(state.tier.put_many, chosen),
                    [key for key, _ in chosen],
                    [],
                    SlotHold.COPY,
                    self.timeout * len(chosen),
                )

    def admit(
        self, state: TierState, blocks: Sequence[tuple[BlockKey, int]], now: float
    ) -> Sequence[tuple[BlockKey, int]]:
        """The (key, slot) pairs to demote to `state`'s tier: those it does not hold already
        (no second write, counted as skipped), then those its admission policies take."""
        if state.indexed:
            knows = state.tier.knows
            chosen: Sequence[tuple[BlockKey, int]] = [b for b in blocks if not knows(b[0])]
        else:
            where, index = self.locator.known.get, state.index
            chosen = [b for b in blocks if not known_at(where(b[0]), index, now)]
        if len(chosen) < len(blocks):
            state.counters[DEMOTIONS_SKIPPED] += len(blocks) - len(chosen)
        history = self.history
        for policy in state.admission:
            chosen = policy.admit(chosen, history, now)
        return chosen

    def _submit(
        self, state: TierState, keys: list[BlockKey], slots: list[int], hold: SlotHold
    ) -> None:
        state.inflight += len(keys)
        self.sink.demotion(
            state,
            functools.partial(put_from, state.tier, self.slot_view, keys, slots),
            keys,
            slots,
            hold,
            self.timeout * max(1, len(keys)),
        )

    def demoted(self, state: TierState, job: Demotion, result: JobResult) -> None:
        """A demotion's result: count it, locate what the tier took, give back what the job
        held."""
        keys = job.keys
        state.inflight -= len(keys)
        outcomes = answers(result, len(keys), result.error or TierError("malformed answer"))
        stored = [key for key, outcome in zip(keys, outcomes, strict=True) if outcome is None]
        state.counters[DEMOTIONS] += len(stored)
        state.counters[BYTES_DEMOTED] += len(stored) * len(self.slot_view(0))  # slots are alike
        state.counters[DEMOTION_FAILURES] += len(keys) - len(stored)
        if stored:
            if not state.indexed:  # an indexed tier knows it has them
                self.locator.found_in(stored, state.index, self.clock())
            self.events.append(TierEvent(state.config.name, tuple(stored)))
        match job.hold:
            case SlotHold.COPY:
                pass  # no slot to give back
            case SlotHold.HELD:
                held_by, release = self._held, []
                for slot in job.slots:
                    left = held_by[slot] - 1
                    if left:
                        held_by[slot] = left
                    else:
                        del held_by[slot]
                        release.append(slot)
                self.pool.release(release)
            case SlotHold.PINNED:
                self.pool.release_demotion(keys)

    def take_events(self) -> list[TierEvent]:
        events, self.events = self.events, []
        return events

    def clear(self) -> None:
        """Forget every demotion (a reset: their results will be dropped); the events not taken
        yet stay."""
        self.through.clear()
        self._held.clear()
        for state in self.tiers:
            state.inflight = 0
