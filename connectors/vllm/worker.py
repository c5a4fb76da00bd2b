"""Worker side: vLLM's `OffloadingWorker` contract served by a kvtier copy engine."""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from connectors.resources import Resources
from connectors.vllm.pointers import blocks_from_pointers
from tiers.copy import CopyEngine, EngineBlocks, GroupRef, KVTensor

__all__ = ["KvtierWorker", "engine_layout"]

log = logging.getLogger(__name__)


def engine_layout(kv_caches: CanonicalKVCaches) -> tuple[list[KVTensor], list[list[GroupRef]]]:
    """vLLM's canonical KV caches as the copy engines' tensors and group references."""
    tensors = [KVTensor(t.tensor, t.page_size_bytes) for t in kv_caches.tensors]
    groups = [
        [GroupRef(ref.tensor_idx, ref.page_size_bytes) for ref in refs]
        for refs in kv_caches.group_data_refs
    ]
    return tensors, groups


class KvtierWorker(OffloadingWorker):
    """vLLM's worker contract over a kvtier copy engine. Worker process, engine thread.

    The engine side of a transfer arrives as vLLM's release gives it
    (`connectors.vllm.versions.VllmTraits.device_pointers`): a `GPULoadStoreSpec` of block ids,
    or `DevicePointers`, resolved back to block ids of the registered KV tensors and checked
    (`connectors.vllm.pointers`). The copy engine sees one form, `EngineBlocks`.

    Nothing raises into vLLM: a transfer the engine cannot do (pointers that do not resolve, a
    copy that fails) is a job reported with `success=False`. What vLLM does with it is its
    release's rule (`VllmTraits.transfer_failures`): from 0.34 a failed store is dropped by
    `complete_store(..., success=False)` and a failed load recomputed; before, vLLM stops on
    it, which a failed local memory copy deserves (tier faults never reach the worker).
    """

    def __init__(self, engine: CopyEngine, resources: Resources) -> None:
        """`resources`: what the worker holds open (the region, the roster, `engine` itself),
        closed at `shutdown`."""
        self.engine = engine
        self.resources = resources

    def submit_store(self, job_id: int, src: Any, dst_spec: LoadStoreSpec) -> bool:
        """`src`: the engine blocks to store (`DevicePointers` or a `GPULoadStoreSpec`)."""
        self.engine.submit_store(job_id, self._blocks(job_id, src), dst_spec.block_ids)  # type: ignore[attr-defined]
        return True

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst: Any, expedited: bool = False
    ) -> bool:
        """`dst`: the engine blocks to load into (`DevicePointers` or a `GPULoadStoreSpec`).
        `expedited` (`VllmTraits.expedited_loads`): the connector waits for this load inside
        the step, so it goes to the copy engine's own lane."""
        self.engine.submit_load(
            job_id,
            src_spec.block_ids,  # type: ignore[attr-defined]
            self._blocks(job_id, dst),
            expedited=expedited,
        )
        return True

    def _blocks(self, job_id: int, spec: Any) -> EngineBlocks:
        if not hasattr(spec, "ptrs"):  # a GPULoadStoreSpec
            return EngineBlocks.of(spec.block_ids, spec.group_sizes, spec.block_indices)
        blocks, problem = blocks_from_pointers(spec, self.engine.tensors, self.engine.groups)
        if problem is not None:
            log.error("kvtier: copy job %d refused (its device pointers: %s)", job_id, problem)
        return blocks

    def get_finished(self) -> list[TransferResult]:
        return [
            TransferResult(r.job_id, r.ok, transfer_size=r.nbytes, transfer_time=r.seconds)
            for r in self.engine.get_finished()
        ]

    def wait(self, job_ids: set[int]) -> None:
        self.engine.wait(job_ids)

    def shutdown(self) -> None:
        self.resources.close()
