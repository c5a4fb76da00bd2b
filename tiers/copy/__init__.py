"""Copy engines: move blocks between an inference engine's KV cache and the primary region.

`CpuCopyEngine` (a background thread) serves vLLM's CPU platform and every CPU test;
`CudaCopyEngine` (streams and batched DMA, in `tiers.copy.cuda`) serves GPUs. Both follow the
contract of `tiers.copy.base` and the byte mapping of `tiers.copy.mapping`.
"""

from tiers.copy.base import CopyEngine, CopyResult, Direction, KVTensor
from tiers.copy.cpu import CpuCopyEngine
from tiers.copy.mapping import EngineBlocks, GroupRef, TensorRows, plan_copy

__all__ = [
    "CopyEngine",
    "CopyResult",
    "CpuCopyEngine",
    "Direction",
    "EngineBlocks",
    "GroupRef",
    "KVTensor",
    "TensorRows",
    "plan_copy",
]
