"""Scheduler side: vLLM's `OffloadingManager` contract served by kvtier's tiering manager."""

from __future__ import annotations

from collections.abc import Collection, Iterable

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

from tiering.keys import BlockKey
from tiering.manager import TierEvent, TieringOffloadingManager
from tiering.metrics import MetricsServer
from tiering.primary import LookupResult as KvtierLookup
from tiers.region import PrimaryRegion

__all__ = ["KvtierManager", "metric_definitions"]

USED = "vllm:kvtier_primary_used_perc"
WRITING = "vllm:kvtier_primary_write_perc"
READING = "vllm:kvtier_primary_read_perc"
TIER_COUNTERS = {
    "lookups": "Blocks looked for in the tier (existence checks).",
    "hits": "Blocks the tier had when looked for.",
    "misses": "Blocks the tier did not have when looked for.",
    "promotions": "Blocks promoted from the tier into the CPU primary.",
    "promotion_failures": "Promotions that failed (error, timeout, corrupt or missing block).",
    "demotions": "Blocks written to the tier.",
    "demotion_failures": "Blocks the tier failed to write.",
    "demotions_dropped": "Demotions dropped because the tier had too many in flight.",
    "demotions_skipped": "Demotions not written: the tier already held the block.",
    "gated": "Tier hits not used because loading was estimated slower than recomputing.",
    "errors": "Tier jobs that failed (the breaker counts these).",
    "bytes_promoted": "Bytes promoted from the tier.",
}
BREAKER = "vllm:kvtier_tier_breaker_open"
LATENCY = "vllm:kvtier_tier_job_seconds"

_LOOKUP = {
    KvtierLookup.HIT: LookupResult.HIT,
    KvtierLookup.PENDING: LookupResult.HIT_PENDING,
    KvtierLookup.MISS: LookupResult.MISS,
    KvtierLookup.RETRY: LookupResult.RETRY,
}


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    definitions: dict[str, OffloadingMetricMetadata] = {
        USED: OffloadingGaugeMetadata(
            documentation="Fraction of kvtier's CPU primary slots holding a block (any state)."
        ),
        WRITING: OffloadingGaugeMetadata(
            documentation="Fraction of kvtier's CPU primary slots being written.",
        ),
        READING: OffloadingGaugeMetadata(
            documentation="Fraction of kvtier's CPU primary slots pinned by loads and demotions."
        ),
        BREAKER: OffloadingGaugeMetadata(
            documentation="1 while a tier's circuit breaker is open or half-open.",
            labelnames=("tier",),
        ),
        LATENCY: OffloadingHistogramMetadata(
            documentation="Duration of kvtier's tier jobs (checks, promotions, demotions).",
            labelnames=("tier",),
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0),
        ),
        "vllm:kvtier_dropped_direct_evictions": OffloadingCounterMetadata(
            documentation="Blocks evicted on the store path before a write-back tier had them."
        ),
        "vllm:kvtier_promotions_late": OffloadingCounterMetadata(
            documentation="Promotions that outlived promotion.deadline (blocks recomputed)."
        ),
    }
    for name, doc in TIER_COUNTERS.items():
        definitions[f"vllm:kvtier_tier_{name}"] = OffloadingCounterMetadata(
            documentation=doc, labelnames=("tier",)
        )
    return definitions


class KvtierManager(OffloadingManager):
    """vLLM's manager contract over a `TieringOffloadingManager`. Scheduler process, scheduler
    thread. Type conversion only: the logic lives in `tiering/`. vLLM 0.32 never calls `touch`,
    so uses reach the policy through `prepare_load` (a hit being loaded) and `prepare_store`
    (a resident block offered again: the request reused it from the GPU's prefix cache)."""

    def __init__(
        self,
        manager: TieringOffloadingManager,
        region: PrimaryRegion,
        metrics_server: MetricsServer | None = None,
    ) -> None:
        """`metrics_server`: kvtier's own Prometheus endpoint, fed by the manager's `publish`
        hook; closed at `shutdown`."""
        self.manager = manager
        self.region = region
        self.metrics_server = metrics_server
        self.medium = Medium.CPU
        self._reported: dict[tuple[str, str], float] = {}

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return _LOOKUP[self.manager.lookup(BlockKey(key))]

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        return CPULoadStoreSpec(self.manager.prepare_load(list(keys)))  # type: ignore[arg-type]

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.manager.complete_load(keys)  # type: ignore[arg-type]

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.manager.touch(keys)  # type: ignore[arg-type]

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        keys = list(keys)
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
        self.manager.complete_store(keys, ok=success)  # type: ignore[arg-type]

    def on_schedule_end(self, ctx: ScheduleEndContext) -> None:
        self.manager.on_schedule_end()

    def has_pending_work(self) -> bool:
        return self.manager.has_pending_work()

    def take_events(self) -> Iterable[OffloadingEvent]:
        for event in self.manager.take_events():
            medium = Medium.STORAGE if isinstance(event, TierEvent) else self.medium
            yield OffloadingEvent(keys=list(event.keys), medium=medium, removed=event.removed)

    def reset_cache(self) -> None:
        self.manager.reset()

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = OffloadingConnectorStats()
        pool = self.manager.pool
        slots = pool.num_slots
        stats.set_gauge(USED, pool.num_used / slots)
        stats.set_gauge(WRITING, pool.num_writing / slots)
        stats.set_gauge(READING, pool.num_reading / slots)
        report = self.manager.stats()
        self._delta(
            stats,
            "vllm:kvtier_dropped_direct_evictions",
            (),
            report["manager"].get("demotions_dropped_direct_eviction", 0),
        )
        self._delta(
            stats, "vllm:kvtier_promotions_late", (), report["manager"].get("promotions_late", 0)
        )
        for tier, figures in report["tiers"].items():
            for name in TIER_COUNTERS:
                self._delta(stats, f"vllm:kvtier_tier_{name}", (tier,), figures.get(name, 0))
            stats.set_gauge(BREAKER, float(figures["breaker"] != "closed"), labelvalues=(tier,))
            for seconds in figures["latencies"]:
                stats.observe_histogram(LATENCY, seconds, labelvalues=(tier,))
        return stats

    def _delta(
        self, stats: OffloadingConnectorStats, name: str, labels: tuple[str, ...], total: float
    ) -> None:
        previous = self._reported.get((name, *labels), 0.0)  # type: ignore[arg-type]
        if total > previous:
            stats.increase_counter(name, total - previous, labelvalues=labels)
            self._reported[(name, *labels)] = total  # type: ignore[index]

    def shutdown(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.close()
        self.manager.shutdown()
        self.region.close()
