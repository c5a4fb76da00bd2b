"""Scheduler side: vLLM's `OffloadingManager` contract served by kvtier's tiering manager.

One adapter for every supported vLLM (`connectors.vllm.versions`): what a release adds (`lock`,
`on_reset_flushed`, `config_info`, `metadata_only` events, failed stores) is served where vLLM
has it and harmless where it does not (an older release never calls the new methods).
docs/DESIGN.md ("vLLM's manager contract") lists, method by method, where kvtier departs from
vLLM's reference manager and why."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from connectors.resources import Resources
from connectors.vllm.caller import caller_local
from connectors.vllm.traffic import RequestTraffic
from connectors.vllm.versions import traits
from tiering.config import Config
from tiering.keys import BlockKey
from tiering.manager import TierEvent, TieringOffloadingManager
from tiering.manager.counters import MANAGER_METRICS, TIER_COUNTERS
from tiering.manager.exported import (
    BREAKER,
    EXPORTED,
    LATENCY,
    LATENCY_BUCKETS,
    READING,
    USED,
    WARM_GAUGES,
    WRITING,
)
from tiering.manager.usage import USAGE_GAUGES
from tiering.primary import LookupResult as KvtierLookup

__all__ = ["CONFIG_INFO_KEYS", "KvtierManager", "config_info", "metric_definitions"]

CONFIG_INFO_KEYS = (
    "kvtier_tier",
    "kvtier_type",
    "kvtier_slots",
    "kvtier_bytes_per_block",
    "kvtier_eviction",
    "kvtier_write_mode",
)
"""Labels of kvtier's series of vLLM 0.33's `vllm:kv_offload_config_info`: one series for the
primary (`kvtier_tier="primary"`, type cpu, its slots, bytes per block and eviction) and one per
secondary tier (its name, type and write mode); a label a series does not have reads empty."""

_SOURCES = {
    "memory": CacheHitSource.HOST,
    "disk": CacheHitSource.DISK,
    "remote": CacheHitSource.EXTERNAL_UNSPECIFIED,
}
"""`Tier.medium` as vLLM's source of cached prompt tokens."""
_RESET_FENCE_STEPS = 4
"""Without `on_reset_flushed` (`VllmTraits.reset_flushed`), the steps after a cache reset until
its slots are reused: the copies in flight at the reset run and are waited for in the next
step, and with asynchronous scheduling a step is scheduled before the last one's output is in;
four leave a margin."""
_MAX_TRACKED_REQUESTS = 4096
"""Requests whose promoted blocks' sources are remembered: vLLM ends each request with
`on_request_finished`; the bound keeps a request it never ends from growing the map."""

_LOOKUP = {
    KvtierLookup.HIT: LookupResult.HIT,
    KvtierLookup.PENDING: LookupResult.HIT_PENDING,
    KvtierLookup.MISS: LookupResult.MISS,
    KvtierLookup.RETRY: LookupResult.RETRY,
}


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """vLLM's definitions of the metrics kvtier exports (`tiering.manager.exported`)."""
    definitions: dict[str, OffloadingMetricMetadata] = {}
    for m in EXPORTED:
        if m.kind == "counter":
            definitions[m.name] = OffloadingCounterMetadata(
                documentation=m.documentation, labelnames=m.labels
            )
        elif m.kind == "gauge":
            definitions[m.name] = OffloadingGaugeMetadata(
                documentation=m.documentation, labelnames=m.labels
            )
        else:
            definitions[m.name] = OffloadingHistogramMetadata(
                documentation=m.documentation, labelnames=m.labels, buckets=LATENCY_BUCKETS
            )
    return definitions


def config_info(config: Config, num_slots: int, block_bytes: int) -> list[dict[str, Any]]:
    """kvtier's series of `vllm:kv_offload_config_info` (`CONFIG_INFO_KEYS`)."""
    series: list[dict[str, Any]] = [
        {
            "kvtier_tier": "primary",
            "kvtier_type": "cpu",
            "kvtier_slots": num_slots,
            "kvtier_bytes_per_block": block_bytes,
            "kvtier_eviction": config.primary.eviction,
        }
    ]
    for tier in config.tiers:
        series.append(
            {"kvtier_tier": tier.name, "kvtier_type": tier.type, "kvtier_write_mode": tier.write}
        )
    return series


class KvtierManager(OffloadingManager):
    """vLLM's manager contract over a `TieringOffloadingManager`. Scheduler process, scheduler
    thread. Type conversion only: the logic lives in `tiering/`. No vLLM calls `touch` (0.34
    removed it from the interface), and kvtier defines none: uses reach the policy through
    `prepare_load` (a hit being loaded) and `prepare_store` (a resident block offered again:
    the request reused it from the GPU's prefix cache), as they happen, not once per request
    at `on_request_finished`.

    A block a request waited for while it was promoted from a secondary tier is reported to
    vLLM as coming from that tier's medium (`get_load_source`: disk for a file tier), so
    `vllm:prompt_tokens_cached` by source shows what the tiers give; every other hit is the
    host's (the CPU primary)."""

    def __init__(
        self,
        manager: TieringOffloadingManager,
        resources: Resources | None = None,
        info: Sequence[Mapping[str, Any]] = ({},),
    ) -> None:
        """`resources`: what the scheduler holds open (the region, the roster, the runtime,
        the tiers, the metrics server, `manager` itself), closed at `shutdown`; None: only
        `manager`. `info`: the series of `config_info` (`config_info()`)."""
        if resources is None:
            resources = Resources()
            resources.manager = manager
        self.manager = manager
        self.resources = resources
        self.medium = Medium.CPU
        self.info = [dict(series) for series in info]
        self._reported: dict[tuple[str, ...], float] = {}
        self._sources: dict[str, dict[OffloadKey, CacheHitSource]] = {}
        """Request id -> the keys it found being promoted, and the source of each."""
        self._traffic = None if manager.traffic is None else RequestTraffic(manager)
        """Each request's blocks, recorded when it ends (`trace.record`; None: off)."""
        vllm = traits()
        self._fenced_reset = vllm.reset_flushed
        self._metadata_only = vllm.metadata_only_events

    @property
    def lock(self) -> AbstractContextManager[Any]:
        """vLLM 0.33's connector enters this around each step's calls. A no-op, deliberately:
        every call vLLM makes comes from the scheduler's thread, and the tiering manager
        excludes its own runtime thread itself (`TieringOffloadingManager.lock`, a `StepLock`
        its methods take from a step's first lookup to `on_schedule_end`). Handing vLLM that
        lock would have it held around calls that take it again, and a `StepLock` is not
        re-entrant (a step never begins inside a step; its owner is the step, not the thread),
        while the runtime's thread, which only ever tries it, would gain nothing."""
        return nullcontext()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._traffic is not None:
            return self._recorded_lookup(key, req_context, self._traffic)
        result = self.manager.lookup(BlockKey(key))
        if result is KvtierLookup.PENDING:
            self._promoted(key, req_context.req_id)
        return _LOOKUP[result]

    def _recorded_lookup(
        self, key: OffloadKey, req_context: ReqContext, traffic: RequestTraffic
    ) -> LookupResult:
        result, where = self.manager.lookup_where(BlockKey(key))
        traffic.looked_up(req_context, BlockKey(key), where)
        if result is KvtierLookup.PENDING:
            self._promoted(key, req_context.req_id)
        return _LOOKUP[result]

    def _promoted(self, key: OffloadKey, request: str) -> None:
        tier = self.manager.promoted_from(BlockKey(key))
        if tier is None:  # PENDING for the engine's own store of the block
            return
        sources = self._sources.get(request)
        if sources is None:
            if len(self._sources) >= _MAX_TRACKED_REQUESTS:
                del self._sources[next(iter(self._sources))]
            sources = self._sources[request] = {}
        sources[key] = _SOURCES.get(tier.medium, CacheHitSource.EXTERNAL_UNSPECIFIED)

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        sources = self._sources.get(req_context.req_id)
        if sources is not None:
            source = sources.get(key)
            if source is not None:
                return source
        return CacheHitSource.HOST

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._sources.pop(req_context.req_id, None)
        if self._traffic is not None:
            self._traffic.finished(req_context)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        return CPULoadStoreSpec(self.manager.prepare_load(list(keys)))  # type: ignore[arg-type]

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.manager.complete_load(keys)  # type: ignore[arg-type]

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        keys = list(keys)
        if self._traffic is not None:
            self._traffic.offered(req_context, keys)  # type: ignore[arg-type]
        grant = self.manager.prepare_store(keys)  # type: ignore[arg-type]
        if grant is None:
            return None
        if len(grant.keys) < len(keys):
            new = set(grant.keys)
            self.manager.touch(key for key in keys if key not in new)  # type: ignore[misc]
        return PrepareStoreOutput(
            keys_to_store=list(grant.keys),
            store_spec=CPULoadStoreSpec(list(grant.slots)),
            evicted_keys=list(grant.evicted),
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """`success=False` (`VllmTraits.transfer_failures`): the store's copy failed, so its
        keys are dropped and their slots freed, never served. Keys not being written are
        ignored, as vLLM's interface says and its reference manager does."""
        self.manager.complete_store(keys, ok=success)  # type: ignore[arg-type]

    def on_schedule_end(self, ctx: ScheduleEndContext) -> None:
        self.manager.on_schedule_end(idle=_empty_step())

    def has_pending_work(self) -> bool:
        return self.manager.has_pending_work()

    def take_events(self) -> Iterable[OffloadingEvent]:
        for event in self.manager.take_events():
            if isinstance(event, TierEvent):
                yield OffloadingEvent(
                    keys=list(event.keys), medium=Medium.STORAGE, removed=event.removed
                )
            elif not event.metadata_only:
                yield OffloadingEvent(
                    keys=list(event.keys), medium=self.medium, removed=event.removed
                )
            elif self._metadata_only:  # else vLLM has no such event, and recorded nothing
                yield OffloadingEvent(
                    keys=list(event.keys), medium=self.medium, removed=True, metadata_only=True
                )

    def reset_cache(self) -> None:
        self._sources.clear()
        self.manager.reset(
            fence=True, fence_steps=None if self._fenced_reset else _RESET_FENCE_STEPS
        )

    def on_reset_flushed(self) -> None:
        self.manager.reset_flushed()

    def config_info(self) -> Sequence[Mapping[str, Any]]:
        return self.info

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = OffloadingConnectorStats()
        pool = self.manager.pool
        slots = pool.num_slots
        stats.set_gauge(USED, pool.num_used / slots)
        stats.set_gauge(WRITING, pool.num_writing / slots)
        stats.set_gauge(READING, pool.num_reading / slots)
        report = self.manager.stats()
        for name, metric in MANAGER_METRICS.items():
            self._delta(stats, metric, (), report["manager"].get(name, 0))
        for name, metric in WARM_GAUGES.items():
            stats.set_gauge(metric, float(report["manager"].get(name, 0)))
        for tier, figures in report["tiers"].items():
            for name in TIER_COUNTERS:
                self._delta(stats, f"vllm:kvtier_tier_{name}", (tier,), figures.get(name, 0))
            stats.set_gauge(BREAKER, float(figures["breaker"] != "closed"), labelvalues=(tier,))
            for name in USAGE_GAUGES:
                if name in figures:
                    value = float(figures[name])
                    stats.set_gauge(f"vllm:kvtier_tier_{name}", value, labelvalues=(tier,))
            for seconds in figures["latencies"]:
                stats.observe_histogram(LATENCY, seconds, labelvalues=(tier,))
        return stats

    def _delta(
        self, stats: OffloadingConnectorStats, name: str, labels: tuple[str, ...], total: float
    ) -> None:
        """Add what a counter grew since the last report; its first report adds its total,
        zero included, so the counter exists in /metrics from the first step."""
        previous = self._reported.get((name, *labels))
        if previous is None or total > previous:
            stats.increase_counter(name, total - (previous or 0.0), labelvalues=labels)
            self._reported[(name, *labels)] = total

    def shutdown(self) -> None:
        if self._traffic is not None:
            self._traffic.flush()  # before the manager, which writes what is queued, closes
        self.resources.close()


def _empty_step() -> bool:
    """Whether the step that calls `on_schedule_end` schedules no token: vLLM's connector
    calls it from `build_connector_meta(scheduler_output)` (every supported release), whose
    argument says. Anything else (another caller, another shape) reads as a step with work."""
    output = caller_local(  # on_schedule_end's caller, only
        "scheduler_output",
        lambda value: hasattr(value, "total_num_scheduled_tokens"),
        above=1,
        depth=1,
    )
    return getattr(output, "total_num_scheduled_tokens", None) == 0
