"""`wire`: the tiering manager's collaborators built and wired together, once (scheduler
process, at the manager's construction).

The facade (`tiering.manager.offloading.TieringOffloadingManager`) holds them; this is the one
place that knows which needs which: the step lock guards them all, the job sink is their one
outbox, the locator is shared by the promoter, the demoter and the bookkeeping, the counters
are one mapping.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tiering.config import Config, TierConfig
from tiering.manager.bookkeeping import Arrivals, Bookkeeping
from tiering.manager.demotion import Demoter
from tiering.manager.fences import ResetFences
from tiering.manager.jobs import JobSink
from tiering.manager.locator import TierLocator
from tiering.manager.manifest import Manifest, engine_identity, read_manifest
from tiering.manager.promotion import Promoter
from tiering.manager.recorder import ManifestRecorder
from tiering.manager.refusals import StoreRefusals
from tiering.manager.steplock import StepLock
from tiering.manager.tierstate import TierState
from tiering.manager.usage import UsagePoller
from tiering.manager.warm import WarmStart
from tiering.placement import BlockHistory, PromotionGate, gate_class
from tiering.primary import PrimaryPool
from tiering.runtime import Runtime
from tiering.tier import Tier

__all__ = ["Parts", "wire"]


@dataclass(frozen=True, slots=True)
class Parts:
    """The manager's collaborators (a value: the objects themselves are the facade's)."""

    tiers: list[TierState]
    counters: defaultdict[str, float]
    lock: StepLock
    """Guards the pool and every part between the scheduler's calls and the runtime's
    bookkeeping. Held by the scheduler from a step's first `lookup` to `on_schedule_end`."""
    history: BlockHistory
    sink: JobSink
    locator: TierLocator
    demoter: Demoter
    promoter: Promoter
    warm: WarmStart
    recorder: ManifestRecorder | None
    """Writes the manifest of use (with a warm start and a persistent writable tier)."""
    fences: ResetFences
    bookkeeping: Bookkeeping
    refusals: StoreRefusals
    usage: UsagePoller


def wire(
    pool: PrimaryPool,
    tiers: Sequence[tuple[TierConfig, Tier]],
    slot_view: Callable[[int], memoryview],
    *,
    config: Config,
    runtime: Runtime,
    block_tokens: int,
    reserve: int | None,
    max_inflight: int,
    clock: Callable[[], float],
    gate: PromotionGate | None,
) -> Parts:
    """The parts of a manager over `pool` and `tiers` (the facade's arguments)."""
    states = [TierState.of(cfg, tier, i) for i, (cfg, tier) in enumerate(tiers)]
    counters: defaultdict[str, float] = defaultdict(float)
    lock = StepLock(forbidden=runtime.on_loop_thread)
    policies = [policy for state in states for policy in state.admission]
    history = BlockHistory(
        tracks_hits=any(p.needs_hits for p in policies),
        tracks_age=any(p.needs_age for p in policies),
    )
    if gate is None:
        gate = gate_class(config.promotion.gate)(
            block_tokens=block_tokens, prefill_rate=config.promotion.prefill_rate
        )
    arrivals = Arrivals()
    sink = JobSink(arrivals.arrived)
    timeout = config.faults.timeout
    locator = TierLocator(states, sink, timeout, clock)
    demoter = Demoter(
        pool,
        states,
        locator,
        history,
        sink,
        slot_view=slot_view,
        timeout=timeout,
        reserve=max(1, pool.num_slots // 10) if reserve is None else reserve,
        max_inflight=max_inflight,
        counters=counters,
        clock=clock,
    )
    promoter = Promoter(
        pool,
        states,
        locator,
        history,
        gate,
        sink,
        slot_view=slot_view,
        deadline=config.promotion.deadline,
        recompute_per_block=block_tokens / config.promotion.prefill_rate,
        counters=counters,
        clock=clock,
        write_back=bool(demoter.write_back),
    )
    block_bytes = max(1, len(slot_view(0)))
    lasting = [state.tier for state in states if state.tier.persistent]
    budget = config.primary.warm_start // block_bytes
    manifest, why, engine = None, "", ""
    if budget and lasting:
        engine = engine_identity(config.primary.engine_id, lasting[0].namespace)
        manifest, why = _read_manifest(runtime, lasting, engine)
    warm = WarmStart(
        pool,
        states,
        promoter,
        counters,
        budget=budget if lasting or any(s.indexed for s in states) else 0,
        block_bytes=block_bytes,
        reserve=demoter.reserve if demoter.write_back else 0,
        manifest=manifest,
        why=why,
    )
    writable = [tier for tier in lasting if not tier.read_only]
    recorder = None
    if budget and writable:
        recorder = ManifestRecorder(
            pool,
            writable,
            lock,
            runtime,
            counters,
            engine=engine,
            interval=config.primary.warm_manifest_interval,
            poll=config.primary.manifest_requests,
            progress=warm.progress,
            first=None if manifest is None else manifest.keys,
        )
    fences = ResetFences(pool, runtime, lock, counters, clock)
    bookkeeping = Bookkeeping(
        states,
        sink,
        arrivals,
        locator=locator,
        promoter=promoter,
        demoter=demoter,
        warm=warm,
        fences=fences,
        history=history,
        runtime=runtime,
        lock=lock,
        counters=counters,
    )
    return Parts(
        tiers=states,
        counters=counters,
        lock=lock,
        history=history,
        sink=sink,
        locator=locator,
        demoter=demoter,
        promoter=promoter,
        warm=warm,
        recorder=recorder,
        fences=fences,
        bookkeeping=bookkeeping,
        refusals=StoreRefusals(pool, slot_view, config.primary.capacity, counters),
        usage=UsagePoller(states, runtime, config.metrics.usage_interval),
    )


MANIFEST_READ_TIMEOUT = 10.0
"""Seconds the manager's construction waits for the manifest (one record per persistent tier);
past them, the warm start follows the tiers' newest."""


def _read_manifest(runtime: Runtime, tiers: list[Tier], engine: str) -> tuple[Manifest | None, str]:
    """The last run's manifest of `engine` from `tiers`, read on the runtime before any request
    (a tier that fails or hangs costs at most `MANIFEST_READ_TIMEOUT`)."""
    namespace = tiers[0].namespace
    try:
        found: tuple[Manifest | None, str] = runtime.run_sync(
            lambda: read_manifest(tiers, namespace, engine), MANIFEST_READ_TIMEOUT
        )
    except Exception as e:  # noqa: BLE001 - no manifest is never a reason not to start
        return None, f"the manifest of engine {engine} was not read: {e}"
    return found
