"""A deliberately broken spec for the end-to-end canary: its loads copy nothing (and still
report success), so the engine computes on whatever its KV blocks held. The end-to-end test
runs it to prove that its own assertions would catch a load that moves no bytes."""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    LoadStoreSpec,
    OffloadingWorker,
)

from connectors.vllm import TieredOffloadingSpec
from connectors.vllm.worker import KvtierWorker
from tiers.copy import EngineBlocks


class _NoCopyLoads(KvtierWorker):
    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst: Any, expedited: bool = False
    ) -> bool:
        """`dst`: a `GPULoadStoreSpec`, or (vLLM 0.34) `DevicePointers`."""
        groups = len(getattr(dst, "group_sizes", None) or dst.group_block_counts)
        self.engine.submit_load(job_id, [], EngineBlocks.of([], [0] * groups, [0] * groups))
        return True


class CanarySpec(TieredOffloadingSpec):
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        worker = super().get_worker(kv_caches)
        assert isinstance(worker, KvtierWorker)
        return _NoCopyLoads(worker.engine, worker.resources)
