"""Replay a request trace through the real primary pool and measure the prefix hit rate.

The trace is a Mooncake one, read by `kvtier.trace`.

Replay semantics (bench/traces/README.md): requests in file order; a request's blocks are
looked up front to back and count as hit while present, stopping at the first absent one; the
hit blocks are used in that order (here: pinned by `prepare_load`, which is the use the policy
sees); then every absent block of the request is stored, evicting by policy but never a block of
the current request. The hit rate is hit tokens over all tokens of the requests whose index is at
least `floor(n / 2)`: the first half warms the cache.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.trace import BLOCK_TOKENS, TraceRequest, trace_keys
from tiering.config import Config, TierConfig
from tiering.keys import BlockKey
from tiering.primary import LookupResult, PrimaryPool
from tiering.stepping import StepDriver
from tiering.tier import Tier

if TYPE_CHECKING:
    from tiering.runtime import Runtime

__all__ = [
    "REPLAY_NAMESPACE",
    "Admitted",
    "ReplayEngine",
    "ReplayResult",
    "TieredReplayResult",
    "replay",
    "replay_tiered",
]


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """Outcome of one replay. Rates are fractions in [0, 1]."""

    policy: str
    capacity: int
    requests: int
    measured_requests: int
    """Requests in the measured (second) half."""
    hit_tokens: int
    total_tokens: int
    """Both over the measured half."""
    block_refs: int
    """Blocks looked up over the whole trace."""
    evictions: int
    unstored_blocks: int
    """Absent blocks that could not be stored because the request alone exceeds the capacity."""

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.total_tokens if self.total_tokens else 0.0


def replay(
    requests: Sequence[TraceRequest],
    capacity: int,
    policy: str = "lru",
    progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Replay `requests` through a `PrimaryPool` of `capacity` blocks (module docstring).

    `progress`, when given, is called with the number of requests done so far, now and then.
    """
    pool = PrimaryPool(capacity, policy)
    measured_from = len(requests) // 2
    hit_tokens = total_tokens = block_refs = evictions = unstored = 0
    lookup, HIT = pool.lookup, LookupResult.HIT
    for index, (request, keys) in enumerate(zip(requests, trace_keys(requests), strict=True)):
        n_hit = 0
        for key in keys:
            if lookup(key) is not HIT:
                break
            n_hit += 1
        hits = keys[:n_hit]
        pool.prepare_load(hits)
        grant = pool.prepare_store(keys[n_hit:])
        if grant is None:
            unstored += len(keys) - n_hit
        else:
            evictions += len(grant.evicted)
            pool.complete_store(grant.keys)
        pool.complete_load(hits)
        block_refs += len(keys)
        if index >= measured_from:
            tokens = request.block_tokens()
            hit_tokens += sum(tokens[:n_hit])
            total_tokens += sum(tokens)
        if progress is not None and index % 256 == 255:
            progress(index + 1)
    if progress is not None:
        progress(len(requests))
    return ReplayResult(
        policy=policy,
        capacity=capacity,
        requests=len(requests),
        measured_requests=len(requests) - measured_from,
        hit_tokens=hit_tokens,
        total_tokens=total_tokens,
        block_refs=block_refs,
        evictions=evictions,
        unstored_blocks=unstored,
    )


@dataclass(frozen=True, slots=True)
class TieredReplayResult:
    """Outcome of a replay through the tiering manager and real tiers."""

    capacity: int
    block_bytes: int
    hit_tokens: int
    """Over the measured half, wherever the blocks came from."""
    total_tokens: int
    tier_hit_tokens: dict[str, int]
    """Of `hit_tokens`, those of blocks promoted from each secondary tier."""
    block_refs: int
    manager_seconds: float
    """Time spent inside the manager's calls (the scheduler-side cost), waits excluded."""
    stats: dict[str, Any]
    seconds_by_call: dict[str, float] = field(default_factory=dict)
    """`manager_seconds` by method."""
    blocks_by_call: dict[str, int] = field(default_factory=dict)
    """Blocks handed to each method (a lookup: one; `on_schedule_end`: one per step)."""

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.total_tokens if self.total_tokens else 0.0

    @property
    def us_per_block(self) -> float:
        return 1e6 * self.manager_seconds / max(self.block_refs, 1)

    @property
    def breakers(self) -> dict[str, str]:
        """Each tier's circuit breaker at the end (`open`: the replay lost its server and
        stopped calling it; `stats` has the times each opened and the jobs it refused)."""
        return {name: figures["breaker"] for name, figures in self.stats["tiers"].items()}


def replay_tiered(
    requests: Sequence[TraceRequest],
    config: Config,
    capacity: int,
    block_bytes: int = 4096,
    progress: Callable[[int], None] | None = None,
) -> TieredReplayResult:
    """Replay through a `TieringOffloadingManager` over `capacity` primary blocks of
    `block_bytes` (synthesized: each block's bytes derive from its key, and every promoted
    block is checked) and the tiers of `config`, really written and read.

    Same semantics as `replay`, with the manager's asynchrony: a lookup that answers RETRY or
    PENDING is asked again after an engine step, and after each request the runtime is let
    finish its work (ample time between requests: no demotion is dropped for lack of it).
    Every step pauses for the model's (`model_step`).
    """
    engine = ReplayEngine(config, capacity, block_bytes, model=model_step())
    measured_from = len(requests) // 2
    hit_tokens = total_tokens = refs = deferrals = 0
    tier_tokens: dict[str, int] = {cfg.name: 0 for cfg in config.tiers}
    try:
        for index, (request, keys) in enumerate(zip(requests, trace_keys(requests), strict=True)):
            admitted = engine.admit(keys)
            deferrals += not admitted.settled
            engine.serve(keys, admitted)
            engine.step()
            refs += len(keys)
            if index >= measured_from:
                tokens = request.block_tokens()
                hit_tokens += sum(tokens[: admitted.hits])
                total_tokens += sum(tokens)
                for i, tier in admitted.promoted.items():
                    tier_tokens[tier] += tokens[i]
            if progress is not None and index % 256 == 255:
                progress(index + 1)
        stats = engine.finish()
        stats["replay"] = {"unsettled_requests": deferrals}
    finally:
        engine.close()
    return TieredReplayResult(
        capacity,
        block_bytes,
        hit_tokens,
        total_tokens,
        tier_tokens,
        refs,
        engine.driver.spent,
        stats,
        engine.driver.seconds,
        engine.driver.blocks,
    )


@dataclass(frozen=True, slots=True)
class Admitted:
    """Any thread (a frozen value): a request as its engine admitted it."""

    hits: int
    """Leading blocks usable (in the primary, or promoted into it for this request)."""
    promoted: dict[int, str]
    """Position in the request -> the tier each promoted block of the hits came from."""
    settled: bool
    """False: still deferred after `MAX_DEFERRALS` steps (its leading hits were used)."""


class ReplayEngine:
    """The replay's thread (it plays the engine's scheduler): one engine of a tiered replay, a
    `TieringOffloadingManager` over `capacity` synthesized primary blocks of `block_bytes`, its
    runtime and a `StepDriver`.

    `tiers` replaces the tiers `config` would build, and `runtime` the runtime it would start
    (a fleet hands each engine its view of one shared tier, on a runtime of its own): what the
    engine opened it closes, what it was given its giver closes; `model` runs in every step,
    after the manager's end of step (the model's forward pass; None: none, the runtime is only
    let finish); `clock` is the manager's; `name` the runtime thread's.
    """

    def __init__(
        self,
        config: Config,
        capacity: int,
        block_bytes: int,
        *,
        tiers: Sequence[tuple[TierConfig, Tier]] | None = None,
        runtime: Runtime | None = None,
        model: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        name: str = "kvtier-runtime",
    ) -> None:
        from tiering.manager import TieringOffloadingManager, build_tiers
        from tiering.runtime import Runtime

        self.config = config
        self.memory = np.zeros((capacity, block_bytes), dtype=np.uint8)
        memory = self.memory
        self._runtime: Runtime | None = None
        """The runtime this engine started (None: it was given one)."""
        self._tiers: list[tuple[TierConfig, Tier]] | None = None
        """The tiers this engine opened (None: it was given them)."""
        if runtime is None:
            runtime = self._runtime = Runtime(config.faults.breaker, name)
        if tiers is None:
            tiers = self._tiers = build_tiers(config, REPLAY_NAMESPACE)
        self.manager = TieringOffloadingManager(
            PrimaryPool(capacity, config.primary.eviction),
            tiers,
            lambda slot: memoryview(memory[slot]),
            config=config,
            runtime=runtime,
            block_tokens=BLOCK_TOKENS,
            clock=clock,
        )
        self.driver = StepDriver(
            self.manager, fill=lambda key, slot: memory.__setitem__(slot, key[0])
        )
        self.model = model

    def step(self) -> None:
        """One engine step: the manager submits what the step queued, the model runs, and the
        runtime is let finish before the next step (ample time between steps)."""
        self.driver.end_step()
        if self.model is not None:
            self.model()
        self.driver.wait_idle(math.inf, ENGINE_STEP)

    def admit(self, keys: Sequence[BlockKey]) -> Admitted:
        """vLLM's scan (tiering.stepping): a deferred request is looked up again, whole, at the
        next step; one never settled uses its leading hits. Recorded, when the manager records
        (`trace.record`)."""
        scan = self.driver.admit(keys, max_scans=MAX_DEFERRALS, between=self.step)
        if self.manager.traffic is not None:  # `trace.record`: the request, as looked up
            self.driver.timed("record", self.manager.record, list(keys))
        return self.admitted(keys, scan.hits, scan.waited, scan.settled)

    def admitted(
        self, keys: Sequence[BlockKey], hits: int, waited: AbstractSet[BlockKey], settled: bool
    ) -> Admitted:
        """A request whose scans found `hits` leading hits, after waiting on `waited` keys:
        each promoted hit (one it waited on) is checked to hold its key's bytes."""
        manager, promoted = self.manager, {}
        for i, key in enumerate(keys[:hits]):
            if key in waited:
                promoted[i] = manager.where(key) or self.config.tiers[0].name
                slot = manager.pool.slot(key)
                assert self.memory[slot, 0] == key[0], "a promoted block holds other bytes"
        return Admitted(hits, promoted, settled)

    def serve(self, keys: Sequence[BlockKey], admitted: Admitted) -> None:
        """Load the admitted hits, store the rest (the caller steps)."""
        self.driver.serve(keys, admitted.hits)

    def finish(self) -> dict[str, Any]:
        """Collect the last step's results (not measured); the manager's stats."""
        self.manager.on_schedule_end()
        return self.manager.stats()

    def close(self, flush: float | None = None) -> None:
        """Shut the manager down (`flush`: as `TieringOffloadingManager.shutdown`), then close
        the tiers and the runtime this engine opened (not those it was given)."""
        from tiering.manager import close_tiers

        self.manager.shutdown(flush=flush)
        runtime = self.manager.runtime
        if self._tiers is not None:
            close_tiers(runtime, self._tiers)
        if self._runtime is not None:
            self._runtime.shutdown()


def model_step() -> Callable[[], None]:
    """The model's step of a replay that measures time: it streams `ENGINE_SWEEP_BYTES`
    through the caches and takes `ENGINE_STEP` seconds, in every configuration."""
    model = np.zeros(ENGINE_SWEEP_BYTES, dtype=np.uint8)

    def step() -> None:
        np.add(model, 1, out=model)
        time.sleep(ENGINE_STEP)

    return step


ENGINE_STEP = 0.0002
"""Seconds a tiered replay pauses after each step, for the model's step."""

ENGINE_SWEEP_BYTES = 16 << 20
"""Bytes the model's step streams through the caches (enough to evict the L2 and much of the L3
of the development machines; a real forward pass streams gigabytes). Every configuration pauses
and sweeps, the primary alone too: a replay that paused only while work was pending measured the
primary alone with warm caches and the tiered setups with cold ones, and charged the difference
to the tiers."""

MAX_DEFERRALS = 32
"""Steps a request may be deferred in a tiered replay before its leading hits are used."""

REPLAY_NAMESPACE = bytes(range(100, 116))
"""The namespace of every replayed block."""
