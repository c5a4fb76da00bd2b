"""Scheduler side: vLLM's `OffloadingManager` contract served by kvtier's primary pool."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tiering.keys import BlockKey
from tiering.primary import LookupResult as PrimaryLookup
from tiering.primary import PrimaryPool
from tiers.region import PrimaryRegion

__all__ = ["KvtierManager", "metric_definitions"]

USED = "vllm:kvtier_primary_used_perc"
WRITING = "vllm:kvtier_primary_write_perc"
READING = "vllm:kvtier_primary_read_perc"

_LOOKUP = {
    PrimaryLookup.HIT: LookupResult.HIT,
    PrimaryLookup.PENDING: LookupResult.HIT_PENDING,
    PrimaryLookup.MISS: LookupResult.MISS,
}


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    return {
        USED: OffloadingGaugeMetadata(
            documentation="Fraction of kvtier's CPU primary slots holding a block (any state)."
        ),
        WRITING: OffloadingGaugeMetadata(
            documentation="Fraction of kvtier's CPU primary slots being written (stores)."
        ),
        READING: OffloadingGaugeMetadata(
            documentation="Fraction of kvtier's CPU primary slots pinned by loads."
        ),
    }


class KvtierManager(OffloadingManager):
    """vLLM's manager contract over a `PrimaryPool`. Scheduler process, scheduler thread.

    Type conversion only: the logic lives in `tiering.primary`. vLLM 0.32 never calls `touch`,
    so uses reach the policy through `prepare_load` (a hit being loaded) and `prepare_store`
    (a resident block offered again: the request reused it from the GPU's prefix cache).
    """

    def __init__(self, pool: PrimaryPool, region: PrimaryRegion) -> None:
        self.pool = pool
        self.region = region
        self.medium = Medium.CPU

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return _LOOKUP[self.pool.lookup(BlockKey(key))]

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        return CPULoadStoreSpec(self.pool.prepare_load(list(keys)))  # type: ignore[arg-type]

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.pool.complete_load(keys)  # type: ignore[arg-type]

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.pool.touch(keys)  # type: ignore[arg-type]

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        keys = list(keys)
        grant = self.pool.prepare_store(keys)  # type: ignore[arg-type]
        if grant is None:
            return None
        if len(grant.keys) < len(keys):
            new = set(grant.keys)
            self.pool.touch(key for key in keys if key not in new)  # type: ignore[misc]
        return PrepareStoreOutput(
            keys_to_store=list(grant.keys),
            store_spec=CPULoadStoreSpec(list(grant.slots)),
            evicted_keys=list(grant.evicted),
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self.pool.complete_store(keys, ok=success)  # type: ignore[arg-type]

    def take_events(self) -> Iterable[OffloadingEvent]:
        for event in self.pool.take_events():
            yield OffloadingEvent(keys=list(event.keys), medium=self.medium, removed=event.removed)

    def reset_cache(self) -> None:
        self.pool.reset()

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = OffloadingConnectorStats()
        slots = self.pool.num_slots
        stats.set_gauge(USED, self.pool.num_used / slots)
        stats.set_gauge(WRITING, self.pool.num_writing / slots)
        stats.set_gauge(READING, self.pool.num_reading / slots)
        return stats

    def shutdown(self) -> None:
        self.region.close()
