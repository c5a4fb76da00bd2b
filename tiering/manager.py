"""`TieringOffloadingManager`: the CPU primary pool plus secondary tiers.

Scheduler process: called on the scheduler's thread, with its bookkeeping on the runtime's
(**Threads**, below). It serves the primary pool's contract (so the vLLM adapter serves it
unchanged) and moves blocks between the primary and the tiers on the runtime, never waiting on
I/O:

- **lookup**: the primary first, then the `indexed` tiers (memory, file: they know what they
  hold without I/O), in order. A key none of them has is looked for in the other tiers (Redis,
  S3) by one batched existence check per tier, submitted at the end of the step; meanwhile the
  answer is RETRY. Once a tier (the first, in order) has it, and the gate lets it through, a
  primary slot is allocated (WRITING) and the promotion queued: PENDING, then HIT once the
  bytes are in. All
  requests that need the block wait on the same promotion. A failed promotion frees the slot and
  remembers the block as absent for a while, so it is not retried every step.
- **demotion**, per tier: `through` copies a block when its store completes; `back` and
  `selective` (after `admit_after_hits` hits) copy blocks that background reclaim takes from the
  least recently used end to keep `reserve` slots free. A block the tier is known to hold
  already (it came from there) is not written again. A slot is pinned or held while a tier
  reads it. At most `max_inflight` blocks per tier are in flight; beyond that, demotions are
  dropped and counted: a slow tier never blocks the primary.
- **gating** (`promotion.gate: auto`): a tier's hit is promoted only while its measured time per
  block (a moving average) beats recomputing the block at `prefill_rate` tokens per second.
- **faults**: every job has a deadline and goes through the tier's circuit breaker, demotions
  through its write breaker too (`tiering.runtime`: a full tier refuses writes and still serves
  promotions); failures are misses, dropped demotions and counters, never exceptions. A
  primary store that cannot be granted is counted and said once (`_store_refused`). A tier
  that cannot stop its I/O at once (the file tier's threads read into primary slots) ends its
  job late rather than let a slot be reused under it; meanwhile a late promotion's key reads
  as MISS (recompute).

**Threads.** The scheduler's calls do only what must be answered now; the runtime's thread does
the rest, under one lock (`lock`): it applies finished jobs (promoted blocks become ready,
demoted blocks' slots are given back) and, between steps, submits the existence checks and
promotions the step queued (allocating their slots), pins write-through blocks and reclaims
slots for write-back demotions. In vLLM that work runs while the model does, not in the
scheduler's step. The scheduler holds the lock from a step's first `lookup` to
`on_schedule_end` (one acquisition per step, not one per call), so a block looked up as HIT is
never reclaimed or evicted before the same step's `prepare_load`; other calls take it one at a
time. The runtime never waits for the lock: it tries, and tries again a tick later. If it missed
a whole window between two steps, `on_schedule_end` does the work itself.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tiering.config import Config, TierConfig
from tiering.errors import TierError
from tiering.keys import BlockKey
from tiering.primary import KeyState, LookupResult, PrimaryEvent, PrimaryPool, StoreGrant
from tiering.runtime import Job, JobResult, Runtime, at_fork_in_child
from tiering.tier import Tier

__all__ = ["TierEvent", "TieringOffloadingManager", "build_tiers"]

log = logging.getLogger(__name__)

_HIT, _PENDING, _MISS, _RETRY = (  # plain globals: an enum member costs ~0.2 µs per access
    LookupResult.HIT,
    LookupResult.PENDING,
    LookupResult.MISS,
    LookupResult.RETRY,
)

_T = TypeVar("_T")

ABSENT = -1
NEGATIVE_TTL = 2.0
"""Seconds a block found in no tier is taken as absent before it is looked for again."""
POSITIVE_TTL = 30.0


def build_tiers(config: Config, namespace: bytes) -> list[tuple[TierConfig, Tier]]:
    """The configured secondary tiers, in order, each with the deployment's secret (`auth`)."""
    from tiering.registry import create_tier

    return [
        (
            cfg,
            create_tier(
                cfg.type,
                namespace=namespace,
                name=cfg.name,
                capacity=cfg.capacity,
                secret=config.auth.secret,
                **{"timeout": config.faults.timeout, **cfg.options},
            ),
        )
        for cfg in config.tiers
    ]


@dataclass(frozen=True, slots=True)
class TierEvent:
    """Keys that a secondary tier now holds (removed=False)."""

    tier: str
    keys: tuple[BlockKey, ...]
    removed: bool = False


@dataclass
class _TierState:
    config: TierConfig
    tier: Tier
    index: int
    indexed: bool = False
    """The tier answers `knows` (no existence checks)."""
    inflight: int = 0
    """Blocks being demoted to this tier."""
    seconds_per_block: float | None = None
    """Moving average of promotion time per block."""
    counters: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    latencies: list[float] = field(default_factory=list)


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
    ) -> None:
        self.pool = pool
        self.tiers = [_TierState(cfg, tier, i, tier.indexed) for i, (cfg, tier) in enumerate(tiers)]
        self._indexed = [t for t in self.tiers if t.indexed]
        self._checked_tiers = [t for t in self.tiers if not t.indexed]
        self._knows = [(t.tier.knows, t.index) for t in self._indexed]
        self.slot_view = slot_view
        self.config = config
        self.runtime = runtime
        self.block_tokens = block_tokens
        self.reserve = max(1, pool.num_slots // 10) if reserve is None else reserve
        self.max_inflight = max_inflight
        self.clock = clock
        self._generation = 0
        self.lock = threading.Lock()
        """Guards the pool and this manager's state between the scheduler's calls and the
        runtime's bookkeeping. Held by the scheduler from a step's first `lookup` to
        `on_schedule_end`; `quiet()` holds it from outside."""
        self._stepping = False  # the scheduler holds `lock` for the rest of this step
        self._step = 0  # `on_schedule_end` calls so far
        self._arrivals: deque[JobResult] = deque()  # finished jobs, to apply under the lock
        self._drain_step = 0  # `_step` when the oldest of `_arrivals` arrived
        self._work_queued = False  # between-step work handed to the runtime, not yet done
        self._ticking = False  # the runtime's hook is at work
        self._stuck: set[int] = set()  # jobs that outlived a reset's drain
        self._quarantined: set[int] = set()  # their possible slots, held until they end
        self._through: list[BlockKey] = []  # stored blocks for the write-through tiers
        self._where: dict[BlockKey, tuple[int, float]] = {}
        self._checking: dict[BlockKey, set[int]] = {}  # key -> tiers yet to answer
        self._found: dict[BlockKey, set[int]] = {}
        self._to_check: list[BlockKey] = []
        self._promotions: dict[int, list[BlockKey]] = defaultdict(list)  # tier -> keys, this step
        self.promoting: set[BlockKey] = set()
        """Keys being promoted (queued this step or in flight): the WRITING keys of the primary
        that the engine did not write, and those queued this step (slots are allocated for a
        tier's whole batch at the end of the step)."""
        self._refused: set[BlockKey] = set()  # no slot at the end of the last step: MISS now
        self._deadlines: deque[tuple[float, list[BlockKey]]] = deque()  # promotions in flight
        self._late: set[BlockKey] = set()
        """Keys whose promotion outlived `promotion.deadline`: MISS (recompute) while the slot
        stays WRITING until the tier lets go of it."""
        self._hits: dict[BlockKey, int] = {}  # kept only for `selective` tiers
        self._stored_at: dict[BlockKey, float] = {}  # kept only for tiers with a `min_age`
        self._held: dict[int, int] = {}  # reclaimed slot -> demotions still reading it
        self._events: list[TierEvent] = []
        self._outbox: list[Job] = []  # submitted together at the end of the step
        self.counters: defaultdict[str, float] = defaultdict(float)
        self._told: set[str] = set()  # the causes of refused stores already logged
        self._write_through = [t for t in self.tiers if t.config.write == "through"]
        self._write_back = [t for t in self.tiers if t.config.write != "through"]
        self._track_hits = any(t.config.write == "selective" for t in self.tiers)
        self._track_age = any(t.config.min_age > 0 for t in self.tiers)
        self.metrics_server = None
        at_fork_in_child(self, _fresh_lock)
        runtime.add_hook(self._on_tick)
        if config.metrics.prometheus_port is not None:
            from tiering.metrics import MetricsServer

            self.metrics_server = MetricsServer(
                config.metrics.prometheus_port, config.metrics.address
            )

    # -- the primary's contract -------------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return self.pool.num_slots

    def lookup(self, key: BlockKey) -> LookupResult:
        if not self._stepping:
            self._begin_step()
        result = self.pool.lookup(key)
        if result is not _MISS:
            if result is _PENDING and key in self._late:
                return _MISS  # its promotion is late: recomputing is sooner
            return result
        if not self.tiers:
            return result
        if key in self.promoting:
            return _PENDING  # queued this step, or its slot not allocated yet
        if key in self._refused:
            return _MISS
        for knows, index in self._knows:
            if knows(key):
                return self._promote(key, index)
        if not self._checked_tiers:
            return _MISS
        where = self._where.get(key)
        if where is not None and where[1] > self.clock():
            return self._promote(key, where[0]) if where[0] != ABSENT else _MISS
        if key not in self._checking:
            self._checking[key] = set()  # queued: submitted at the end of the step
            self._to_check.append(key)
        return _RETRY

    def prepare_store(self, keys: Iterable[BlockKey]) -> StoreGrant | None:
        grant, jobs = self._locked(self._prepare_store, keys)
        if jobs:  # demotions of copies (`_demote_evicted`): they hold no slot
            self.runtime.submit_many(jobs)
        return grant

    def _prepare_store(self, keys: Iterable[BlockKey]) -> tuple[StoreGrant | None, list[Job]]:
        keys = keys if isinstance(keys, list | tuple) else list(keys)
        grant = self.pool.prepare_store(keys)
        if grant is None:
            self._store_refused(keys)
            return None, []
        if grant.evicted:
            if self._write_back:
                self._demote_evicted(grant)
            self._forget(grant.evicted)
        if self._track_age:
            self._stored_at.update(dict.fromkeys(grant.keys, self.clock()))
        jobs, self._outbox = self._outbox, []
        return grant, jobs

    def _store_refused(self, keys: Sequence[BlockKey]) -> None:
        """Count a store the primary refused, and say why, once per cause for this manager (one
        per scheduler process in vLLM): a request that needs more slots at once than the
        primary has (`stores_refused_too_large`: it is never offloaded, whatever happens), or
        one that finds too few free or evictable slots now (`stores_refused_no_room`: the rest
        are pinned, being written or held; vLLM offers the blocks again next step)."""
        pool = self.pool
        wanted = dict.fromkeys(keys)
        new = sum(1 for key in wanted if key not in pool)
        cause = "too_large" if len(wanted) > pool.num_slots else "no_room"
        self.counters[f"stores_refused_{cause}"] += 1
        self.counters["store_blocks_refused"] += new
        if cause in self._told:
            return
        self._told.add(cause)
        slot_bytes = len(self.slot_view(0))
        capacity = self.config.primary.capacity
        now = "unset: vLLM's cpu_bytes_to_use" if capacity is None else _size(capacity)
        if cause == "too_large":
            log.warning(
                "kvtier: a store of %d blocks (%d not in the primary) was refused: the primary "
                "has %d slots of %d bytes in all, fewer than the request needs at once, so no "
                "block of a request this long is offloaded. Raise primary.capacity (now %s) to "
                "at least %s (%d slots). Counted in stores_refused_too_large; said once.",
                len(wanted),
                new,
                pool.num_slots,
                slot_bytes,
                now,
                _size(len(wanted) * slot_bytes),
                len(wanted),
            )
            return
        ready = pool.num_used - pool.num_writing - pool.num_reading
        protected = sum(1 for key in wanted if pool.state(key) is KeyState.READY)
        log.warning(
            "kvtier: a store of %d blocks (%d not in the primary) was refused: of the primary's "
            "%d slots of %d bytes, %d are free and %d evictable; %d are pinned (being loaded or "
            "demoted), %d being written, %d held by demotions. vLLM offers the blocks again "
            "next step; if this recurs, raise primary.capacity (now %s). Counted in "
            "stores_refused_no_room; said once.",
            len(wanted),
            new,
            pool.num_slots,
            slot_bytes,
            pool.num_free,
            ready - protected,
            pool.num_reading,
            pool.num_writing,
            pool.num_held,
            now,
        )

    def complete_store(self, keys: Iterable[BlockKey], ok: bool = True) -> None:
        self._locked(self._complete_store, list(keys), ok)

    def _complete_store(self, keys: list[BlockKey], ok: bool) -> None:
        self.pool.complete_store(keys, ok=ok)
        if ok and self._write_through:
            self._through += keys  # pinned and demoted by the runtime, between steps

    def prepare_load(self, keys: Sequence[BlockKey]) -> list[int]:
        if not self._stepping:
            self._begin_step()
        slots = self.pool.prepare_load(keys)
        if self._track_hits:
            hits = self._hits
            for key in keys:
                hits[key] = hits.get(key, 0) + 1
        return slots

    def complete_load(self, keys: Iterable[BlockKey]) -> None:
        self._locked(self.pool.complete_load, keys)

    def touch(self, keys: Iterable[BlockKey]) -> None:
        self._locked(self.pool.touch, keys)

    def reset(self, drain_timeout: float = 30.0) -> None:
        """Wait for in-flight jobs (they may be writing or reading primary slots), then forget
        the primary and every job; the tiers keep their blocks. vLLM calls this between steps,
        never in one, so the wait (bounded by the jobs' deadlines) is allowed here."""
        self._end_step()  # the runtime applies what finishes meanwhile
        deadline = self.clock() + drain_timeout
        while self.runtime.pending() and self.clock() < deadline:
            time.sleep(0.001)
        self.runtime.poll()
        with self.lock:
            stuck = self.runtime.pending_ids()
            keep: set[int] = set()
            if stuck:  # jobs that did not end (a hung disk): their slots stay out of use
                keep = self.pool.slots_in_use() | self._quarantined
                self.counters["reset_slots_quarantined"] += len(keep - self._quarantined)
                self._stuck |= stuck
            self._quarantined = keep
            self._generation += 1
            self.pool.reset(keep)
            self._arrivals.clear()
            self._work_queued = False
            self._through.clear()
            self._where.clear()
            self._checking.clear()
            self._found.clear()
            self._to_check.clear()
            self._promotions.clear()
            self.promoting.clear()
            self._refused.clear()
            self._deadlines.clear()
            self._late.clear()
            self._outbox.clear()
            self._hits.clear()
            self._stored_at.clear()
            self._held.clear()
            for t in self.tiers:
                t.inflight = 0

    def take_events(self) -> list[PrimaryEvent | TierEvent]:
        return self._locked(self._take_events)

    def _take_events(self) -> list[PrimaryEvent | TierEvent]:
        events: list[PrimaryEvent | TierEvent] = list(self.pool.take_events())
        events += self._events
        self._events = []
        return events

    def has_pending_work(self) -> bool:
        return bool(
            self.runtime.pending()
            or self._arrivals
            or self._work_queued
            or self._ticking
            or self._to_check
            or self._outbox
            or self._through
            or any(self._promotions.values())
        )

    def on_schedule_end(self) -> None:
        """Once per engine step, after its lookups and loads: hand the step's existence checks,
        promotions and write-through demotions to the runtime, which submits them and reclaims
        for write-back demotions between steps (or do it here, when the runtime missed the last
        window)."""
        if not self._stepping:
            self.lock.acquire()
        jobs: list[Job] = []
        nudge = False
        try:
            self._step += 1
            self._refused.clear()
            late = self._work_queued  # queued at the last step's end, and not done since
            late_drain = self._arrivals and self._drain_step < self._step - 1
            if late or late_drain:  # the runtime did not get the lock between two steps
                self.counters["bookkeeping_on_scheduler"] += 1
                self._between()
                jobs, self._outbox = self._outbox, []
            elif not self._work_queued and self._between_due():
                self._work_queued = nudge = True
            if self.metrics_server is not None:
                self.metrics_server.publish(self._snapshot())
        finally:
            self._stepping = False
            self.lock.release()
        if jobs:
            self.runtime.submit_many(jobs)
        if nudge:
            self.runtime.nudge()

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Hold the runtime's bookkeeping still (for a consistent look at the state)."""
        if self._stepping:
            yield
            return
        with self.lock:
            yield

    def snapshot(self) -> dict[str, Any]:
        """Counters and gauges as plain numbers (no latency samples: `stats` drains those)."""
        return self._locked(self._snapshot)

    def _snapshot(self) -> dict[str, Any]:
        pool = self.pool
        tiers = {
            state.config.name: {
                **state.counters,
                "inflight_demotions": state.inflight,
                **self._breakers(state.config.name),
                **{f"tier.{k}": v for k, v in state.tier.counters.items()},
            }
            for state in self.tiers
        }
        primary = {
            "slots": pool.num_slots,
            "used": pool.num_used,
            "writing": pool.num_writing,
            "reading": pool.num_reading,
            "held": pool.num_held,
        }
        return {"primary": primary, "manager": dict(self.counters), "tiers": tiers}

    def shutdown(self, timeout: float = 5.0) -> None:
        self._end_step()
        if self.metrics_server is not None:
            self.metrics_server.close()
        for t in self.tiers:
            try:
                self.runtime.run_sync(t.tier.close, timeout)
            except Exception:  # closing must not stop the rest from closing
                self.counters["close_errors"] += 1
        self.runtime.shutdown()

    # -- lookups and promotions -----------------------------------------------------------------

    def _promote(self, key: BlockKey, index: int) -> LookupResult:
        if self.config.promotion.gate != "always" and not self._gate_open(self.tiers[index]):
            self.tiers[index].counters["gated"] += 1
            return _MISS
        self._promotions[index].append(key)
        self.promoting.add(key)
        return _PENDING

    def _gate_open(self, state: _TierState) -> bool:
        gate = self.config.promotion.gate
        if gate != "auto":
            return gate == "always"
        if state.seconds_per_block is None:
            return True  # nothing measured yet: try, and learn
        recompute = self.block_tokens / self.config.promotion.prefill_rate
        return state.seconds_per_block < recompute

    def _submit_checks(self) -> None:
        if not self._to_check:
            return
        keys, self._to_check = self._to_check, []
        for key in keys:
            self._checking[key] = {t.index for t in self._checked_tiers}
            self._found[key] = set()
        for state in self._checked_tiers:
            tier = state.tier
            self._outbox.append(
                Job(
                    state.config.name,
                    functools.partial(tier.contains, keys),
                    self.config.faults.timeout,
                    tag=("check", self._generation, state.index, keys),
                    done=self._arrived,
                )
            )
            state.counters["lookups"] += len(keys)

    def _submit_promotions(self) -> None:
        """Allocate primary slots for each tier's queued promotions (one `prepare_store` per
        tier) and submit them. Keys that get no slot read as MISS during the next step."""
        for index, keys in self._promotions.items():
            if not keys:
                continue
            state = self.tiers[index]
            grant = self.pool.prepare_store(keys) or self._allocate_some(keys)
            if len(grant.keys) < len(keys):
                granted = set(grant.keys)
                left = [key for key in keys if key not in granted]
                self.promoting.difference_update(left)
                refused = [key for key in left if self.pool.lookup(key) is _MISS]
                self._refused.update(refused)  # (the others became resident meanwhile)
                self.counters["promotion_allocation_failures"] += len(refused)
            if grant.evicted:
                self._forget(grant.evicted)
                if self._write_back:
                    self.counters["demotions_dropped_direct_eviction"] += len(grant.evicted)
            if not grant.keys:
                continue
            batch = list(zip(grant.keys, grant.slots, strict=True))
            deadline = self.config.promotion.deadline
            self._deadlines.append((self.clock() + deadline, list(grant.keys)))
            self._outbox.append(
                Job(
                    state.config.name,
                    functools.partial(_get_into, state.tier, self.slot_view, batch),
                    deadline,
                    tag=("promote", self._generation, index, batch),
                    done=self._arrived,
                )
            )
        self._promotions.clear()

    def _allocate_some(self, keys: list[BlockKey]) -> StoreGrant:
        """As many of `keys` as the primary can take, in order (a batch that does not fit)."""
        new: list[BlockKey] = []
        slots: list[int] = []
        evicted: list[BlockKey] = []
        for key in keys:
            grant = self.pool.prepare_store([key])
            if grant is None:
                break
            new += grant.keys
            slots += grant.slots
            evicted += grant.evicted
        return StoreGrant(tuple(new), tuple(slots), tuple(evicted))

    # -- demotions -------------------------------------------------------------------------------

    def _demote_through(self) -> None:
        """Pin the blocks stored since the last time and demote them to the write-through
        tiers. One evicted meanwhile (it was not pinned yet) is dropped and counted."""
        if not self._through:
            return
        lookup = self.pool.lookup
        queued = dict.fromkeys(self._through)
        self._through = []
        stored = [key for key in queued if lookup(key) is _HIT]
        if len(stored) < len(queued):
            for state in self._write_through:
                state.counters["demotions_dropped"] += len(queued) - len(stored)
        for state in self._write_through:
            keys = [key for key in stored if not self._holds(state, key)]
            if not keys:
                continue
            room = self.max_inflight - state.inflight
            if room <= 0:
                state.counters["demotions_dropped"] += len(keys)
                continue
            batch = keys[:room]
            state.counters["demotions_dropped"] += len(keys) - len(batch)
            slots = self.pool.pin(batch)  # unpinned when the tier has them (_demoted)
            self._submit_demotion(state, batch, slots, held=False)

    def _reclaim(self) -> None:
        if not self._write_back:
            return
        free = self.pool.num_free
        need = self.reserve - free - self.pool.num_held
        room = min(self.max_inflight - t.inflight for t in self._write_back)
        n = min(need, room)
        if n <= 0:
            return
        victims = self.pool.reclaim(n)
        if not victims:
            return
        now = self.clock()
        held = self._held
        for state in self._write_back:
            chosen = self._admit(state, victims, now)
            if chosen:
                slots = [s for _, s in chosen]
                for slot in slots:
                    held[slot] = held.get(slot, 0) + 1
                self._submit_demotion(state, [k for k, _ in chosen], slots, held=True)
        self._forget(key for key, _ in victims)
        release = [slot for _, slot in victims if slot not in held]
        if release:
            self.pool.release(release)

    def _demote_evicted(self, grant: StoreGrant) -> None:
        """Blocks evicted on the store path, whose slots now belong to new blocks: their bytes
        stay there until the engine's copy runs (a later step), so copy them out now and demote
        the copies. A memcpy per block on this thread: background reclaim keeps these rare, and
        `max_inflight` bounds them (beyond it they are dropped and counted)."""
        self.counters["direct_evictions"] += len(grant.evicted)
        now = self.clock()
        copies: dict[int, bytes] = {}
        for state in self._write_back:
            room = self.max_inflight - state.inflight
            chosen: list[tuple[BlockKey, bytes]] = []
            evicted = list(zip(grant.evicted, grant.evicted_slots, strict=True))
            for key, slot in self._admit(state, evicted, now):
                if len(chosen) >= room:
                    state.counters["demotions_dropped"] += 1
                    continue
                if slot not in copies:
                    copies[slot] = bytes(self.slot_view(slot))
                chosen.append((key, copies[slot]))
            if chosen:
                state.inflight += len(chosen)
                keys = [key for key, _ in chosen]
                self._outbox.append(
                    Job(
                        state.config.name,
                        functools.partial(state.tier.put_many, chosen),
                        self.config.faults.timeout * len(chosen),
                        tag=("demote", self._generation, state.index, (keys, [], "copy")),
                        done=self._arrived,
                        writes=True,
                    )
                )

    def _admit(
        self, state: _TierState, blocks: Sequence[tuple[BlockKey, int]], now: float
    ) -> list[tuple[BlockKey, int]]:
        """The (key, slot) pairs to demote to `state`'s tier: those it does not hold already
        (no second write), hit often enough (`selective`) and old enough (`min_age`)."""
        if state.indexed:
            knows = state.tier.knows
            chosen = [block for block in blocks if not knows(block[0])]
        else:
            where, index = self._where.get, state.index
            chosen = [block for block in blocks if not _known_at(where(block[0]), index, now)]
        if len(chosen) < len(blocks):
            state.counters["demotions_skipped"] += len(blocks) - len(chosen)
        cfg = state.config
        if cfg.write == "selective":
            hits, need = self._hits.get, cfg.admit_after_hits
            chosen = [block for block in chosen if hits(block[0], 0) >= need]
        if cfg.min_age > 0:
            stored_at, age = self._stored_at.get, cfg.min_age
            chosen = [block for block in chosen if now - stored_at(block[0], now) >= age]
        return chosen

    def _submit_demotion(
        self, state: _TierState, keys: list[BlockKey], slots: list[int], held: bool
    ) -> None:
        state.inflight += len(keys)
        self._outbox.append(
            Job(
                state.config.name,
                functools.partial(_put_from, state.tier, self.slot_view, keys, slots),
                self.config.faults.timeout * max(1, len(keys)),
                tag=("demote", self._generation, state.index, (keys, slots, held)),
                done=self._arrived,
                writes=True,
            )
        )

    # -- results ---------------------------------------------------------------------------------

    def _begin_step(self) -> None:
        self.lock.acquire()
        self._stepping = True

    def _end_step(self) -> None:
        if self._stepping:
            self._stepping = False
            self.lock.release()

    def _locked(self, function: Callable[..., _T], *args: Any) -> _T:
        """`function(*args)` under the lock, unless the scheduler holds it for the step."""
        if self._stepping:
            return function(*args)
        with self.lock:
            return function(*args)

    def _between_due(self) -> bool:
        """Whether the runtime has between-step work (checked under the lock)."""
        return bool(
            self._to_check
            or self._promotions
            or self._through
            or (self._write_back and self.pool.num_free + self.pool.num_held < self.reserve)
        )

    def _on_tick(self) -> bool:
        """The runtime's hook, on its thread at every tick: apply finished jobs, mark late
        promotions, and do the between-step work once a step has handed it over. Never waits
        for the lock: if the scheduler holds it, next tick. Whether it did or has work."""
        if not (
            self._arrivals
            or self._work_queued
            or (self._deadlines and self._deadlines[0][0] <= self.clock())
            or self._stuck
        ):
            return False
        if not self.lock.acquire(blocking=False):
            return True
        self._ticking = True  # pending work, for `has_pending_work` on other threads
        try:
            start, cpu = time.perf_counter(), time.thread_time()
            if self._work_queued:
                self._between()
            else:
                self._drain()
            if self._stuck and self._stuck.isdisjoint(self.runtime.pending_ids()):
                self.pool.release(self._quarantined)  # the jobs a reset outlived have ended
                self._stuck, self._quarantined = set(), set()
            jobs, self._outbox = self._outbox, []
            if jobs:
                self.runtime.submit_from_loop(jobs)
            self.counters["bookkeeping_seconds"] += time.perf_counter() - start
            self.counters["bookkeeping_cpu_seconds"] += time.thread_time() - cpu
        finally:
            self._ticking = False
            self.lock.release()
        return True

    def _between(self) -> None:
        """Apply finished jobs, submit the queued checks, write-through demotions and
        promotions (allocating their slots), and reclaim for write-back demotions. Between two
        steps only: allocating and reclaiming evict blocks."""
        self._work_queued = False
        self._drain()
        self._submit_checks()
        self._demote_through()
        self._submit_promotions()
        self._reclaim()

    def _arrived(self, result: JobResult) -> None:
        """A job's `done` handler, on the runtime's thread: applied under the lock at the next
        tick (`_on_tick`)."""
        if not self._arrivals:
            self._drain_step = self._step
        self._arrivals.append(result)

    def _drain(self) -> None:
        """Apply the finished jobs, and mark promotions past their deadline late."""
        now = self.clock()
        while self._deadlines and self._deadlines[0][0] <= now:
            late = [key for key in self._deadlines.popleft()[1] if key in self.promoting]
            self._late.update(late)
            self.counters["promotions_late"] += len(late)
        arrivals = self._arrivals
        while arrivals:
            result = arrivals.popleft()
            kind, generation, index, payload = result.tag
            if generation != self._generation:
                continue  # from before a reset
            state = self.tiers[index]
            if result.ok and result.fault is None:
                state.latencies.append(result.seconds)
            else:  # failed, refused, or a batch that faulted (`JobResult.fault`)
                state.counters["errors"] += 1
            if kind == "check":
                self._checked(state, payload, result)
            elif kind == "promote":
                self._promoted(state, payload, result)
            else:
                keys, slots, held = payload
                self._demoted(state, keys, slots, held, result)

    def _checked(self, state: _TierState, keys: list[BlockKey], result: JobResult) -> None:
        answers = _answers(result, len(keys), False)
        now = self.clock()
        for key, present in zip(keys, answers, strict=True):
            waiting = self._checking.get(key)
            if waiting is None:
                continue
            waiting.discard(state.index)
            if present:
                self._found[key].add(state.index)
                state.counters["hits"] += 1
            else:
                state.counters["misses"] += 1
            if not waiting:
                del self._checking[key]
                found = self._found.pop(key)
                if found:
                    self._where[key] = (min(found), now + POSITIVE_TTL)
                else:
                    self._where[key] = (ABSENT, now + NEGATIVE_TTL)

    def _promoted(
        self, state: _TierState, batch: list[tuple[BlockKey, int]], result: JobResult
    ) -> None:
        found = _answers(result, len(batch), False)
        arrived: list[BlockKey] = []
        missing: list[BlockKey] = []
        for (key, _), ok in zip(batch, found, strict=True):
            (arrived if ok is True else missing).append(key)
        self.promoting.difference_update(key for key, _ in batch)
        if self._late:
            self._late.difference_update(key for key, _ in batch)
        if arrived:
            self.pool.complete_store(arrived)
            state.counters["promotions"] += len(arrived)
            state.counters["bytes_promoted"] += len(arrived) * len(self.slot_view(batch[0][1]))
            per_block = result.seconds / len(batch)
            previous = state.seconds_per_block
            state.seconds_per_block = (
                per_block if previous is None else 0.8 * previous + 0.2 * per_block
            )
        if missing:
            self.pool.complete_store(missing, ok=False)
            state.counters["promotion_failures"] += len(missing)
            now = self.clock()
            for key in missing:
                self._where[key] = (ABSENT, now + NEGATIVE_TTL)

    def _demoted(
        self,
        state: _TierState,
        keys: list[BlockKey],
        slots: list[int],
        held: bool | str,
        result: JobResult,
    ) -> None:
        state.inflight -= len(keys)
        outcomes = _answers(result, len(keys), result.error or TierError("malformed answer"))
        stored = [key for key, outcome in zip(keys, outcomes, strict=True) if outcome is None]
        state.counters["demotions"] += len(stored)
        state.counters["demotion_failures"] += len(keys) - len(stored)
        if stored:
            if not state.indexed:  # an indexed tier knows it has them
                self._where.update(
                    dict.fromkeys(stored, (state.index, self.clock() + POSITIVE_TTL))
                )
            self._events.append(TierEvent(state.config.name, tuple(stored)))
        if held == "copy":
            pass  # demoted from copies: no slot to give back
        elif held:
            held_by, release = self._held, []
            for slot in slots:
                left = held_by[slot] - 1
                if left:
                    held_by[slot] = left
                else:
                    del held_by[slot]
                    release.append(slot)
            self.pool.release(release)
        else:
            self.pool.unpin(keys)

    def _holds(self, state: _TierState, key: BlockKey) -> bool:
        """Whether `state`'s tier is known to hold `key` (demoted there or found there lately,
        for a tier without an index)."""
        if state.indexed:
            return bool(state.tier.knows(key))
        return _known_at(self._where.get(key), state.index, self.clock())

    def where(self, key: BlockKey) -> str | None:
        """The first tier known to hold `key`, by name (None: none known)."""
        return self._locked(self._where_is, key)

    def _where_is(self, key: BlockKey) -> str | None:
        for state in self._indexed:
            if state.tier.knows(key):
                return state.config.name
        known = self._where.get(key)
        return None if known is None or known[0] == ABSENT else self.tiers[known[0]].config.name

    def _forget(self, keys: Iterable[BlockKey]) -> None:
        if self._track_hits or self._track_age:
            for key in keys:
                self._hits.pop(key, None)
                self._stored_at.pop(key, None)

    # -- metrics ----------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters per tier and of the manager, breaker states, and the latency samples since
        the last call (for histograms)."""
        return self._locked(self._stats)

    def _stats(self) -> dict[str, Any]:
        tiers = {}
        for state in self.tiers:
            samples, state.latencies = state.latencies, []
            tiers[state.config.name] = {
                **state.counters,
                "inflight_demotions": state.inflight,
                **self._breakers(state.config.name),
                "seconds_per_block": state.seconds_per_block,
                "latencies": samples,
                **{f"tier.{k}": v for k, v in state.tier.counters.items()},
            }
        return {"manager": dict(self.counters), "tiers": tiers}

    def _breakers(self, tier: str) -> dict[str, Any]:
        """A tier's breakers: `breaker` is the state of the one every job passes (closed,
        open, half-open), `write_breaker` the one demotions pass too (opened by a full tier
        while promotions go on); the times each opened, the jobs each refused."""
        breaker, writes = self.runtime.breaker(tier), self.runtime.write_breaker(tier)
        return {
            "breaker": breaker.state,
            "breaker_opened": breaker.opened,
            "breaker_refused": breaker.refused,
            "write_breaker": writes.state,
            "write_breaker_opened": writes.opened,
            "write_breaker_refused": writes.refused,
        }


def _fresh_lock(manager: TieringOffloadingManager) -> None:
    """In a forked child: the runtime's thread may have held the lock, and it stays with the
    parent."""
    manager.lock = threading.Lock()
    manager._stepping = False


def _size(n: int) -> str:
    """Bytes as a config writes them, rounded up to a tenth of the unit (`1.6GiB`)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{-(-n * 10 >> shift) / 10:g}{unit}"
    return str(n)


def _known_at(where: tuple[int, float] | None, index: int, now: float) -> bool:
    """Whether a `_where` entry says tier `index` holds the block, and is still fresh."""
    return where is not None and where[0] == index and where[1] > now


def _get_into(
    tier: Tier, slot_view: Callable[[int], memoryview], batch: list[tuple[BlockKey, int]]
) -> Awaitable[list[bool | BaseException]]:
    """A promotion, made on the runtime's thread (slot views cost the scheduler nothing)."""
    return tier.get_many([(key, slot_view(slot)) for key, slot in batch])


def _put_from(
    tier: Tier, slot_view: Callable[[int], memoryview], keys: list[BlockKey], slots: list[int]
) -> Awaitable[list[BaseException | None]]:
    """A demotion from primary slots, made on the runtime's thread."""
    return tier.put_many([(key, slot_view(slot)) for key, slot in zip(keys, slots, strict=True)])


def _answers(result: JobResult, n: int, failed: Any) -> list[Any]:
    """A batch job's per-item answers; `failed` for each item when the job failed or a tier
    answered with the wrong number of items (a third-party tier's bug stays a miss here)."""
    value = result.value
    if not result.ok or not isinstance(value, list) or len(value) != n:
        return [failed] * n
    return value
