"""Worker side: vLLM's `OffloadingWorker` contract served by a kvtier copy engine."""

from __future__ import annotations

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from connectors.resources import Resources
from tiers.copy import CopyEngine, EngineBlocks, GroupRef, KVTensor

__all__ = ["KvtierWorker", "engine_layout"]


def engine_layout(kv_caches: CanonicalKVCaches) -> tuple[list[KVTensor], list[list[GroupRef]]]:
    """vLLM's canonical KV caches as the copy engines' tensors and group references."""
    tensors = [KVTensor(t.tensor, t.page_size_bytes) for t in kv_caches.tensors]
    groups = [
        [GroupRef(ref.tensor_idx, ref.page_size_bytes) for ref in refs]
        for refs in kv_caches.group_data_refs
    ]
    return tensors, groups


def _blocks(spec: GPULoadStoreSpec) -> EngineBlocks:
    return EngineBlocks.of(spec.block_ids, spec.group_sizes, spec.block_indices)


class KvtierWorker(OffloadingWorker):
    """vLLM's worker contract over a kvtier copy engine. Worker process, engine thread.

    Type conversion only. A failed copy is reported as `success=False`: vLLM's connector
    (0.32 and 0.33) has no failure path and stops on it, which is what a failed local memory
    copy deserves (it is a bug, not a tier fault: tier faults never reach the worker).
    """

    def __init__(self, engine: CopyEngine, resources: Resources) -> None:
        """`resources`: what the worker holds open (the region, the roster, `engine` itself),
        closed at `shutdown`."""
        self.engine = engine
        self.resources = resources

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        self.engine.submit_store(job_id, _blocks(src_spec), dst_spec.block_ids)  # type: ignore[attr-defined]
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        """`expedited` (vLLM 0.33, with `sync_load_budget_bytes`): the connector waits for
        this load inside the step, so it goes to the copy engine's own lane."""
        self.engine.submit_load(
            job_id,
            src_spec.block_ids,  # type: ignore[attr-defined]
            _blocks(dst_spec),
            expedited=expedited,
        )
        return True

    def get_finished(self) -> list[TransferResult]:
        return [
            TransferResult(r.job_id, r.ok, transfer_size=r.nbytes, transfer_time=r.seconds)
            for r in self.engine.get_finished()
        ]

    def wait(self, job_ids: set[int]) -> None:
        self.engine.wait(job_ids)

    def shutdown(self) -> None:
        self.resources.close()
