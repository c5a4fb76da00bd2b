"""Which engine block goes to which slot: the byte mapping both copy engines follow.

vLLM 0.32 describes a transfer with a `GPULoadStoreSpec` on the engine side (block ids, grouped
by offloaded KV group) and a list of chunk ids on the offload side; a chunk (our slot) holds
`blocks_per_chunk` engine blocks. For each group g with n = group_sizes[g] > 0 blocks:

    skip    = block_indices[g] % blocks_per_chunk     # sub-blocks before the first one, in the
                                                      # first chunk (a partial first chunk)
    nchunks = ceil((n + skip) / blocks_per_chunk)     # slots this group consumes, in order
    sub-block k of the group  <->  flat index (slot * blocks_per_chunk + j), the (skip + k)-th
                                   of that group's slots' sub-blocks

and every KV tensor the group refers to is copied for each pair. All engine block ids and all
slots must be consumed exactly. `plan_copy` computes this once, vectorized; the CPU engine turns
it into memmoves and the CUDA engine into a batched copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["EngineBlocks", "GroupRef", "TensorRows", "plan_copy"]

IntArray = np.ndarray[Any, np.dtype[np.int64]]


@dataclass(frozen=True, slots=True)
class EngineBlocks:
    """Engine (GPU) blocks of one transfer, vLLM's `GPULoadStoreSpec` without vLLM (worker
    process, any thread: a value).

    `block_ids` is concatenated group by group; `group_sizes[g]` and `block_indices[g]` are
    per offloaded-group position, `block_indices[g]` being the index within the request
    of group g's first block (it fixes where in its first slot the group starts).
    """

    block_ids: IntArray
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]

    @classmethod
    def of(
        cls,
        block_ids: Sequence[int] | np.ndarray[Any, Any],
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
    ) -> EngineBlocks:
        return cls(
            np.array(block_ids, dtype=np.int64).reshape(-1),
            tuple(int(n) for n in group_sizes),
            tuple(int(i) for i in block_indices),
        )


@dataclass(frozen=True, slots=True)
class GroupRef:
    """One KV tensor a group's blocks live in (worker process, any thread: a value), and how
    many bytes of its page are the group's (the unpadded page size; the tensor's page may be
    padded)."""

    tensor_index: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class TensorRows:
    """Copies within one KV tensor (worker process, any thread: a value): engine row
    `engine_rows[i]` <-> sub-block `slot_rows[i]` (flat: slot * blocks_per_chunk + j),
    `nbytes` each."""

    tensor_index: int
    nbytes: int
    engine_rows: IntArray
    slot_rows: IntArray


def plan_copy(
    blocks: EngineBlocks,
    slots: Sequence[int] | np.ndarray[Any, Any],
    blocks_per_chunk: int,
    groups: Sequence[Sequence[GroupRef]],
) -> list[TensorRows]:
    """The copies of one transfer (module docstring). Raises ValueError when the two sides do
    not describe the same blocks; bounds are checked by the engines, which know the sizes."""
    if blocks_per_chunk <= 0:
        raise ValueError(f"blocks_per_chunk must be positive, got {blocks_per_chunk}")
    sizes, starts = blocks.group_sizes, blocks.block_indices
    if len(sizes) != len(groups) or len(starts) != len(groups):
        raise ValueError(
            f"transfer names {len(sizes)} groups ({len(starts)} start indices); "
            f"the KV cache has {len(groups)} offloaded groups"
        )
    ids = blocks.block_ids
    chunk_ids = np.asarray(slots, dtype=np.int64).reshape(-1)
    sub = np.arange(blocks_per_chunk, dtype=np.int64)
    out: list[TensorRows] = []
    g_off = s_off = 0
    for g, n in enumerate(sizes):
        if n < 0 or starts[g] < 0:
            raise ValueError(f"group {g}: negative size {n} or start index {starts[g]}")
        if n == 0:
            continue
        skip = starts[g] % blocks_per_chunk
        nchunks = -(-(n + skip) // blocks_per_chunk)
        group_slots = chunk_ids[s_off : s_off + nchunks]
        if len(group_slots) < nchunks:
            raise ValueError(
                f"group {g}: {n} blocks from sub-block {skip} need {nchunks} slots; "
                f"only {len(group_slots)} left of {len(chunk_ids)}"
            )
        engine = ids[g_off : g_off + n]
        if len(engine) < n:
            raise ValueError(f"group {g}: {n} blocks, only {len(engine)} block ids left")
        if blocks_per_chunk == 1:
            flat = group_slots
        else:
            flat = (group_slots[:, None] * blocks_per_chunk + sub).reshape(-1)[skip : skip + n]
        seen: set[int] = set()
        for ref in groups[g]:
            if ref.tensor_index in seen:  # layers aliasing one tensor: copy its bytes once
                continue
            seen.add(ref.tensor_index)
            out.append(TensorRows(ref.tensor_index, ref.nbytes, engine, flat))
        g_off += n
        s_off += nchunks
    if g_off != len(ids) or s_off != len(chunk_ids):
        raise ValueError(
            f"transfer leaves {len(ids) - g_off} block ids and {len(chunk_ids) - s_off} slots "
            "unused: the two sides describe different blocks"
        )
    return out
