"""A fleet replay's engines over their shared tier, and the requests through them, arrival by
arrival (the `kvtier.fleet` docstring says how)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, cast

from kvtier.fleet.figures import EngineFigures
from kvtier.fleet.recency import STAT_TOUCHES
from kvtier.fleet.shared import EngineTier, Write, WriteLedger
from kvtier.replay import MAX_DEFERRALS, REPLAY_NAMESPACE, Admitted, ReplayEngine
from kvtier.trace import TraceRequest
from tiering.config import Config, tier_from_config
from tiering.errors import TierError
from tiering.keys import BlockKey, store_namespace
from tiering.runtime import Runtime
from tiering.tier import Tier, TierStat

__all__ = ["STORE_SAMPLE", "UNTIMED_GAP", "Fleet", "FleetRun", "arrivals"]

UNTIMED_GAP = 1.0
"""Seconds after the previous request that a request without a timestamp arrives."""
STORE_SAMPLE = 512
"""Requests between two looks at the shared store's bytes (its peak is the largest seen), at
most: a replay of fewer than 16 times as many looks 16 times, so that its measured half has
some."""
STAT_TIMEOUT = 60.0
"""Seconds a look at the shared store may take (a real store lists its keys for it)."""


class TraceClock:
    """The managers' clock (any thread reads it; the replay's thread sets it): the arrival
    time, in the trace's seconds, of the requests being admitted."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def replayed(config: Config, engine: int) -> Config:
    """`config` for replayed engine `engine`: an identity of its own on the store
    (`primary.engine_id` `replay-<engine>`), as each engine of a fleet has one, so that where
    the engines write manifests of use (a warm start) each writes its own, as a fleet's do, not
    one record all of them overwrite (told as a clash)."""
    primary = dataclasses.replace(config.primary, engine_id=f"replay-{engine}")
    return dataclasses.replace(config, primary=primary)


class Fleet:
    """The replay's thread: `engines` replayed engines of `capacity` primary blocks each, over
    the one tier of `config`: one in-process tier they all use (`stand_in`, the memory tier)
    or one tier each on the same store.

    A store whose tiers keep an index of their own (a `files` directory: each instance knows
    what it wrote and what it found at its start) is looked at through a fresh read-only
    instance (its start-up scan sees the whole store), and whether it holds a block is its
    last writer's index's answer (each engine evicts only what its own index knows; one that
    rewrote the block and evicted it since is not seen)."""

    def __init__(
        self, config: Config, engines: int, capacity: int, block_bytes: int, stand_in: bool
    ) -> None:
        from tiering.manager import build_tiers

        self.config = config
        self.clock = TraceClock()
        self.ledger = WriteLedger(engines)
        self.tier_name = config.tiers[0].name
        self.inners: list[Tier] = []
        self.views: list[EngineTier] = []
        self.engines: list[ReplayEngine] = []
        self.runtimes: list[Runtime] = []
        """Each engine's runtime, the fleet's: its view is closed on it, before it stops."""
        self.shared: Tier | None = None
        self.indexed = False
        """Each engine's tier has an index of its own (`files`)."""
        self.touchy = config.tiers[0].type in STAT_TOUCHES
        """The store's `stat` would use every object it counts (`STAT_TOUCHES`)."""
        self.store_error: str | None = None
        """Why the store could not say what it holds, the last time it was asked."""
        lock = threading.Lock() if stand_in else None
        try:
            if stand_in:
                ((_, self.shared),) = build_tiers(config, REPLAY_NAMESPACE)
                self.inners.append(self.shared)
            for engine in range(engines):
                if self.shared is not None:
                    inner = self.shared
                else:
                    ((_, inner),) = build_tiers(config, REPLAY_NAMESPACE)
                    self.inners.append(inner)
                    self.indexed = inner.indexed
                holds = self._writer_holds if self.indexed else None
                view = EngineTier(inner, engine, self.ledger, shared_lock=lock, holds=holds)
                self.views.append(view)
                runtime = Runtime(config.faults.breaker, f"kvtier-engine-{engine}")
                self.runtimes.append(runtime)
                self.engines.append(
                    ReplayEngine(
                        replayed(config, engine),
                        capacity,
                        block_bytes,
                        tiers=[(config.tiers[0], view)],
                        runtime=runtime,
                        clock=self.clock,
                    )
                )
        except BaseException:
            self.close()
            raise

    async def _writer_holds(self, key: BlockKey, last: Write) -> bool:
        return bool(self.inners[last.engine].knows(key))

    def store_stat(self) -> TierStat | None:
        """What the shared store holds: asked through the first engine's runtime, or of a
        fresh read-only instance where each engine's tier indexes only its own. None when the
        store cannot say (a store that fails: the replay goes on, with misses, as an engine
        would; `store_error` says why)."""
        try:
            if not self.indexed:
                runtime = self.engines[0].manager.runtime
                look = self._untouched if self.touchy else self.views[0].stat
                return cast(TierStat, runtime.run_sync(look, STAT_TIMEOUT))
            return asyncio.run(self._fresh_stat())
        except TierError as e:
            self.store_error = str(e)
            return None

    async def _untouched(self) -> TierStat:
        """The replay's namespace in the store's `usage`, which a medium whose `stat` would
        count as a use of every object answers without one (`STAT_TOUCHES`); its bytes are
        the store's own for them (Redis: `MEMORY USAGE`, key and overhead included)."""
        stored = store_namespace(REPLAY_NAMESPACE, self.config.auth.secret)
        usage = await self.views[0].usage(STAT_TIMEOUT)
        mine = [u for u in usage if u.namespace == stored]
        objects, used = (mine[0].objects, mine[0].bytes_used) if mine else (0, 0)
        return TierStat(objects, used, self.views[0].capacity)

    async def _fresh_stat(self) -> TierStat:
        config = self.config
        stored = store_namespace(REPLAY_NAMESPACE, config.auth.secret)  # (as `build_tiers`)
        fresh = tier_from_config(
            config.tiers[0], stored, config, default_timeout=STAT_TIMEOUT, read_only=True
        )
        async with fresh:
            return await fresh.stat()

    def store_counters(self) -> dict[str, int]:
        """The store's own events, summed over its instances."""
        total: Counter[str] = Counter()
        for inner in self.inners:
            total.update(inner.counters)
        return dict(total)

    def close(self) -> None:
        """Stop every engine without a flush (the replay is over), then close what the fleet
        opened: each engine's view (and through it its own tier on a real store) on that
        engine's runtime, the runtime, and the tiers no view closes: the stand-in, or a tier
        whose engine was never built."""
        from tiering.manager import close_tiers

        for engine in self.engines:
            engine.close(flush=0)
        config = self.config.tiers[0]
        for view, runtime in zip(self.views, self.runtimes, strict=False):
            close_tiers(runtime, [(config, view)])
        for runtime in self.runtimes:
            runtime.shutdown()
        left = [self.shared] if self.shared is not None else self.inners[len(self.engines) :]
        for tier in left:
            asyncio.run(tier.close())


class FleetRun:
    """The replay's thread: the requests through a fleet, arrival by arrival, and what each
    engine found."""

    def __init__(
        self,
        fleet: Fleet,
        requests: Sequence[TraceRequest],
        keys: list[list[BlockKey]],
        assignment: list[int],
        progress: Callable[[int], None] | None = None,
        pace: float | None = None,
    ) -> None:
        self.fleet = fleet
        self.requests = requests
        self.keys = keys
        self.assignment = assignment
        self.progress = progress
        self.measured_from = len(requests) // 2
        self.counts = [Counter[str]() for _ in fleet.engines]
        self.stats: list[dict[str, Any]] = []
        """Each manager's stats once the requests are done (`run`)."""
        self.done = 0
        self.peak = 0
        """The most bytes the shared store held at a look."""
        self.held: list[int] = []
        """The objects the shared store held at each look in the measured half (from its
        first look after `measured_from` requests)."""
        self._every = max(1, min(STORE_SAMPLE, len(requests) // 16))
        self._next_look = self._every
        self.pace = pace
        """Trace seconds per wall-clock second (None: as fast as the engines go)."""
        self.lag = 0.0
        """With `pace`: the most wall-clock seconds an arrival came later than its due time
        (the engines and the store could not keep up)."""
        self.span = 0.0
        """Trace seconds from the first arrival to the last (`run`)."""

    def run(self) -> None:
        """Every request; then each engine's last step's results are collected."""
        started = time.monotonic()
        groups = arrivals(self.requests)
        first = groups[0][0] if groups else 0.0
        self.span = groups[-1][0] - first if groups else 0.0
        for arrival, group in groups:
            if self.pace is not None:
                self._wait(started + (arrival - first) / self.pace)
            self.fleet.clock.now = arrival
            queues: dict[int, list[int]] = {}
            for index in group:
                queues.setdefault(self.assignment[index], []).append(index)
            while queues:  # a wave: the next request of each engine that has one
                wave = sorted(queue.pop(0) for queue in queues.values())
                queues = {e: queue for e, queue in queues.items() if queue}
                self._wave(wave)
                self.done += len(wave)
                if self.done >= self._next_look:
                    self._next_look += self._every
                    stat = self.fleet.store_stat()
                    self.peak = max(self.peak, stat.bytes_used if stat else 0)
                    if stat is not None and self.done >= self.measured_from:
                        self.held.append(stat.objects)
                if self.progress is not None:
                    self.progress(self.done)
        self.stats = [engine.finish() for engine in self.fleet.engines]

    def _wait(self, due: float) -> None:
        """Sleep until `due` (`time.monotonic`), or count how late it is."""
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:
            self.lag = max(self.lag, -delay)

    def _wave(self, wave: list[int]) -> None:
        """Admit the wave's requests in the same steps, each on its engine (vLLM's scan;
        deferred ones scanned again at the next step, at most `MAX_DEFERRALS` steps, as
        `StepDriver.admit`), serve each once it settles, and step every engine that scanned,
        one after another."""
        engines = self.fleet.engines
        waited: dict[int, set[BlockKey]] = {index: set() for index in wave}
        hits: dict[int, int] = {}
        pending = wave
        for _ in range(MAX_DEFERRALS):
            deferred = []
            for index in pending:
                engine = engines[self.assignment[index]]
                scan = engine.driver.scan(self.keys[index])
                waited[index] |= scan.waited
                if scan.deferred:
                    deferred.append(index)
                    hits[index] = scan.hits
                else:
                    admitted = engine.admitted(self.keys[index], scan.hits, waited[index], True)
                    self._serve(index, admitted)
            for index in pending:
                engines[self.assignment[index]].step()
            pending = deferred
            if not pending:
                return
        for index in pending:  # never settled: its leading hits are used
            engine = engines[self.assignment[index]]
            self._serve(index, engine.admitted(self.keys[index], hits[index], waited[index], False))
            engine.step()

    def _serve(self, index: int, admitted: Admitted) -> None:
        """Count what request `index` found (its promoted hits' writers as the ledger has them
        now, before it stores anything) and serve it."""
        e = self.assignment[index]
        keys = self.keys[index]
        count = self.counts[e]
        count["requests"] += 1
        count["unsettled_requests"] += not admitted.settled
        if index >= self.measured_from:
            tokens = self.requests[index].block_tokens()
            count["measured_requests"] += 1
            count["total_tokens"] += sum(tokens)
            count["hit_tokens"] += sum(tokens[: admitted.hits])
            writer = self.fleet.ledger.writer
            for i in admitted.promoted:
                count["shared_hit_tokens"] += tokens[i]
                count["shared_hit_blocks"] += 1
                stored_by = writer(keys[i])
                if stored_by is not None and stored_by != e:
                    count["cross_hit_tokens"] += tokens[i]
                    count["cross_hit_blocks"] += 1
        self.fleet.engines[e].serve(keys, admitted)

    def figures(self) -> list[EngineFigures]:
        """Each engine's figures (after `run`)."""
        ledger, name = self.fleet.ledger, self.fleet.tier_name
        rows = []
        for e, stats in enumerate(self.stats):
            tier = {k: v for k, v in stats["tiers"].get(name, {}).items() if k != "latencies"}
            rows.append(
                EngineFigures.of(
                    e,
                    self.counts[e],
                    ledger.writes[e],
                    ledger.duplicates[e],
                    ledger.duplicate_bytes[e],
                    tier,
                )
            )
        return rows


def arrivals(requests: Sequence[TraceRequest]) -> list[tuple[float, list[int]]]:
    """The requests' indexes by arrival, in file order: consecutive requests with the same
    timestamp arrive together; one without arrives alone, `UNTIMED_GAP` after the one before.
    Time never goes back (a request stamped earlier than the one before arrives alone, at the
    time of the one before)."""
    out: list[tuple[float, list[int]]] = []
    now: float = 0.0
    last: float | None = None
    for index, stamp in enumerate(request.timestamp for request in requests):
        if stamp is not None and stamp == last:
            out[-1][1].append(index)
            continue
        if stamp is None:
            now = now + UNTIMED_GAP if index else 0.0
        else:
            now = max(now, stamp)
        last = stamp
        out.append((now, [index]))
    return out
