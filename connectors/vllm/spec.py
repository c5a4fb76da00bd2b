"""`TieredOffloadingSpec`: kvtier as an out-of-tree offloading spec of vLLM (the releases of
`connectors.vllm.versions`; one code base, what each release adds served where it exists).

vLLM builds the spec from `kv_connector_extra_config` in the scheduler and in every worker:

- `config`: the path of a kvtier YAML file, or
- `kvtier`: the same structure inline;
- `cpu_bytes_to_use`: the primary capacity when the YAML gives no `primary.capacity`;
- `block_size` / `blocks_per_chunk`: tokens per kvtier block (vLLM validates them);
- `sync_load_budget_bytes` (read by vLLM, `VllmTraits.expedited_loads`): hits within this many
  bytes per step are loaded inside the step, on the copy engine's expedited lane.

The scheduler gets a `KvtierManager` over a `PrimaryPool` (and, with `metrics.prometheus_port`,
kvtier's Prometheus endpoint, fed a snapshot every step); each worker a `KvtierWorker` over a
copy engine (CUDA on GPUs, CPU on vLLM's CPU platform). Both map the same primary region,
named after vLLM's engine id, so blocks never cross a pipe. What a role holds open is opened
through a `connectors.resources.Resources`, which the adapter's `shutdown` closes.

Every role computes the namespace (`connectors.startup.namespace_layout`) from the engine's
configuration and logs it, one line an operator can compare between processes and engines:
`kvtier namespace <digest> (scheduler|worker rank N): <layout as JSON>`. kvtier's log records go
to vLLM's log handler.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import vllm
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from connectors.resources import Resources
from connectors.startup import (
    check_block_hashing,
    lasting_tiers,
    namespace_layout,
    primary_capacity,
    read_config,
)
from connectors.vllm.caller import caller_local
from connectors.vllm.manager import (
    CONFIG_INFO_KEYS,
    KvtierManager,
    config_info,
    metric_definitions,
)
from connectors.vllm.versions import check_vllm_version
from connectors.vllm.worker import KvtierWorker, engine_layout
from tiering import gil
from tiering.errors import ConfigError
from tiering.keys import store_namespace
from tiering.manager import TieringOffloadingManager
from tiering.primary import PrimaryPool
from tiers.copy import CopyEngine, CpuCopyEngine
from tiers.region import RegionLayout

__all__ = ["TieredOffloadingSpec"]

log = logging.getLogger(__name__)


class TieredOffloadingSpec(OffloadingSpec):
    """kvtier's offloading spec. Built in the scheduler process and in each worker process."""

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        return metric_definitions()

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """The labels of kvtier's series of `vllm:kv_offload_config_info` (0.33+)."""
        return CONFIG_INFO_KEYS

    def __init__(self, config: OffloadingConfig) -> None:
        check_vllm_version(vllm.__version__)
        super().__init__(config)
        if config.canonical_layout:
            raise ConfigError(
                "kv_connector_extra_config.canonical_layout is not supported by kvtier"
            )
        self.replicated_layout = config.replicated_layout
        self.kvtier = read_config(self.extra_config)
        gil.configure(self.kvtier.promotion.switch_interval)
        _join_vllm_logging()
        vllm_config, self.role = _engine_config()
        check_block_hashing(
            str(vllm_config.cache_config.prefix_caching_hash_algo),
            os.environ.get("PYTHONHASHSEED"),
            lasting_tiers(self.kvtier),
        )

        shard_bytes = config.worker_kv_bytes_per_block * self.blocks_per_chunk
        workers = 1 if self.replicated_layout else config.parallel.world_size
        stride = RegionLayout(1, shard_bytes, workers).slot_stride
        capacity = primary_capacity(self.kvtier, self.extra_config)
        num_slots = capacity // stride
        if num_slots < 1:
            raise ConfigError(
                f"primary.capacity: {capacity} bytes hold no block; one block takes {stride} "
                f"bytes over {workers} worker(s)"
            )
        self.region_layout = RegionLayout(num_slots, shard_bytes, workers)
        self.namespace = namespace_layout(config, vllm_config, self.blocks_per_chunk)
        log.info(
            "kvtier: %d primary slots of %d bytes (%s eviction)",
            num_slots,
            stride,
            self.kvtier.primary.eviction,
        )
        log.info(
            "kvtier namespace %s (%s): %s",
            self.namespace.namespace_hex(),
            self.role,
            self.namespace.canonical_json().decode(),
        )
        if self.kvtier.auth.secret is not None:
            stored = store_namespace(self.namespace.namespace(), self.kvtier.auth.secret)
            log.info("kvtier stores it under the secret's names, as namespace %s", stored.hex())

    def get_manager(self) -> OffloadingManager:
        pool = PrimaryPool(
            self.region_layout.num_slots,
            self.kvtier.primary.eviction,
            events=self.kv_events_config.enable_kv_cache_events,
        )
        resources = Resources()
        try:
            region = resources.open_region(
                self.config.engine_id, self.region_layout, self.kvtier, "scheduler"
            )
            if self.kvtier.primary.prefault:
                # the tiers read into slots in this process
                region.prefault(sync=self.kvtier.primary.prefault_sync)
            slots = region.slots()
            block_bytes = self.region_layout.shard_bytes * self.region_layout.num_workers

            def slot_view(slot: int) -> memoryview:
                return memoryview(slots[slot, :block_bytes])

            server = resources.open_metrics_server(self.kvtier)
            runtime, tiers = resources.open_tiers(self.kvtier, self.namespace.namespace())
            manager = resources.manager = TieringOffloadingManager(
                pool,
                tiers,
                slot_view,
                config=self.kvtier,
                runtime=runtime,
                block_tokens=self.config.groups[0].tokens_per_block * self.blocks_per_chunk,
                publish=None if server is None else server.publish,
            )
        except BaseException:
            resources.close()
            raise
        info = config_info(self.kvtier, self.region_layout.num_slots, block_bytes)
        return KvtierManager(manager, resources, info)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self.kvtier.tiers and self.config.parallel.world_size > 1:
            _refuse_workers_across_nodes([tier.name for tier in self.kvtier.tiers])
        rank = 0 if self.replicated_layout else self.config.parallel.rank
        resources = Resources()
        try:
            region = resources.open_region(
                self.config.engine_id, self.region_layout, self.kvtier, f"worker rank {rank}"
            )
            tensors, groups = engine_layout(kv_caches)
            shard = region.shard_tensor(rank)
            engine: CopyEngine
            if tensors and tensors[0].tensor.is_cuda:
                from tiers.copy.cuda import CudaCopyEngine

                pinned = region.pin(rank)  # this worker's shard; False: logged, pageable
                engine = CudaCopyEngine(
                    tensors, groups, shard, self.blocks_per_chunk, pinned=pinned
                )
            else:
                if self.kvtier.primary.prefault:
                    # (pinning maps every page, for CUDA)
                    region.prefault(rank, sync=self.kvtier.primary.prefault_sync)
                engine = CpuCopyEngine(tensors, groups, shard, self.blocks_per_chunk)
            resources.engine = engine
        except BaseException:
            resources.close()
            raise
        return KvtierWorker(engine, resources)


def _refuse_workers_across_nodes(tiers: list[str]) -> None:
    """Refuse secondary tiers on an engine whose workers span nodes, as vLLM 0.34 refuses its
    own (vllm-project/vllm#54415). The tiers run in the scheduler and read and write the primary
    region in its node's shared memory, where a worker on another node never wrote its shard:
    they would demote blocks that are missing a part, and promote into slots it never reads.
    The workers form a grid of tensor, pipeline and (where vLLM has it) prefill-context parallel
    groups, so they share one node if every such group does. Collective over each group: every
    rank joins every group's check before any of them raises."""
    from vllm.distributed import parallel_state

    spans = []
    for name in ("get_tp_group", "get_pp_group", "get_pcp_group"):
        get_group = getattr(parallel_state, name, None)
        if get_group is None:  # a release without that kind of parallelism
            continue
        group = get_group()
        spans.append(
            group.world_size > 1
            and not all(parallel_state.in_the_same_node_as(group.cpu_group, source_rank=0))
        )
    if any(spans):
        raise ConfigError(
            f"kvtier's secondary tiers ({', '.join(tiers)}) need every vLLM worker of the "
            "engine on the scheduler's node (the primary is that node's shared memory); this "
            "engine's workers span several nodes: remove the tiers or keep the engine on one node"
        )


def _engine_config() -> tuple[VllmConfig, str]:
    """The `VllmConfig` of the connector that is building this spec (`caller_local`: vLLM hands
    a spec only its `OffloadingConfig`), and its role (`scheduler` or `worker rank N`). A spec
    built any other way is refused rather than given a namespace that would differ from the
    workers'."""
    owner = caller_local("self", lambda value: isinstance(value, KVConnectorBase_V1))
    if owner is None:
        raise ConfigError(
            "TieredOffloadingSpec must be built by vLLM's OffloadingConnector (kv_connector "
            "'OffloadingConnector'): it takes the engine's configuration from it"
        )
    vllm_config: VllmConfig = owner._vllm_config
    if owner.role == KVConnectorRole.SCHEDULER:
        return vllm_config, "scheduler"
    return vllm_config, f"worker rank {vllm_config.parallel_config.rank}"


def _join_vllm_logging() -> None:
    """kvtier's records go where vLLM's go (its handlers and level), unless the application
    configured kvtier's loggers itself: vLLM configures only its own logger tree, and the
    namespace, tier and breaker messages would otherwise be dropped."""
    engine = logging.getLogger("vllm")
    for name in ("connectors", "tiering", "tiers"):
        logger = logging.getLogger(name)
        if logger.handlers or not engine.handlers:
            continue
        for handler in engine.handlers:
            logger.addHandler(handler)
        logger.setLevel(engine.level)
        logger.propagate = False
