"""vLLM 0.34's `DevicePointers` as the copy engines' `EngineBlocks`. Worker process, vLLM's
worker thread (a pure function of its arguments).

Since 0.34 vLLM's connector resolves a transfer's engine blocks to flat device pointers before
it calls the worker (`vllm/v1/kv_offload/pointer_utils.py`, `resolve_device_pointers`): for each
KV cache group, for each of the group's data references (a KV tensor and its unpadded page
size), for each of the group's blocks, `ptrs[i] = tensor.data_ptr() + block_id *
tensor.stride(0)` and `sizes[i] = page_size_bytes`.

kvtier's copy engines address the engine's KV cache by block id within the tensors they were
given at registration (`tiers.copy.mapping`), as vLLM's `GPULoadStoreSpec` did before 0.34.
This module turns the pointers back into those block ids, checking every pointer on the way: it
must lie on a row of the tensor its data reference names, within that tensor, every reference of
a group must name the same rows, and every size must be that reference's page size. A pointer that
fails any check resolves to block -1, which the engine refuses as a failed job: a stray pointer
is never a copy to or from memory outside the KV caches. One form, block ids, then serves every
vLLM release (docs/DESIGN.md, "vLLM versions").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from tiers.copy import EngineBlocks, GroupRef, KVTensor

__all__ = ["DevicePointersLike", "blocks_from_pointers"]

INVALID = -1
"""The block id of a pointer that does not resolve: out of every bound the engine checks."""


class DevicePointersLike(Protocol):
    """What this module reads of vLLM 0.34's `DevicePointers`."""

    ptrs: np.ndarray[Any, Any]
    sizes: np.ndarray[Any, Any]
    group_block_counts: tuple[int, ...]
    group_data_ref_counts: tuple[int, ...]
    block_indices: tuple[int, ...]


def blocks_from_pointers(
    pointers: DevicePointersLike,
    tensors: Sequence[KVTensor],
    groups: Sequence[Sequence[GroupRef]],
) -> tuple[EngineBlocks, str | None]:
    """The engine blocks `pointers` name in `tensors` (grouped as `groups`, the engine's
    layout), and None; or, where a pointer does not resolve, the same shape with every block of
    the transfer at `INVALID` and one line saying which check failed first."""
    counts = tuple(int(n) for n in pointers.group_block_counts)
    indices = tuple(int(i) for i in pointers.block_indices)
    total = sum(counts)
    ptrs = np.asarray(pointers.ptrs, dtype=np.uint64).reshape(-1)
    sizes = np.asarray(pointers.sizes, dtype=np.uint64).reshape(-1)
    ids = np.empty(total, dtype=np.int64)
    problem = _shape_problem(pointers, counts, indices, groups, len(ptrs), len(sizes))
    if problem is None:
        offset = block = 0
        for g, count in enumerate(counts):
            if count == 0:
                continue  # no pointers for it (`iter_pointer_groups` skips it too)
            refs = groups[g]
            rows: np.ndarray[Any, np.dtype[np.int64]] | None = None
            for r, ref in enumerate(refs):
                part = slice(offset + r * count, offset + (r + 1) * count)
                found, problem = _rows(ptrs[part], sizes[part], tensors[ref.tensor_index], ref)
                if problem is not None:
                    problem = f"group {g}, data reference {r}: {problem}"
                    break
                if rows is None:
                    rows = found
                elif not np.array_equal(rows, found):
                    problem = f"group {g}: data reference {r} names other blocks than reference 0"
                    break
            if problem is not None:
                break
            assert rows is not None  # a group with blocks has references (_shape_problem)
            ids[block : block + count] = rows
            block += count
            offset += count * len(refs)
    if problem is not None:
        ids.fill(INVALID)
    return EngineBlocks(ids, counts, indices), problem


def _shape_problem(
    pointers: DevicePointersLike,
    counts: tuple[int, ...],
    indices: tuple[int, ...],
    groups: Sequence[Sequence[GroupRef]],
    num_ptrs: int,
    num_sizes: int,
) -> str | None:
    refs = tuple(int(n) for n in pointers.group_data_ref_counts)
    if not len(counts) == len(refs) == len(indices) == len(groups):
        return (
            f"{len(counts)} groups of blocks, {len(refs)} of data references and "
            f"{len(indices)} block indices for an engine of {len(groups)} groups"
        )
    for g, (n, layout) in enumerate(zip(refs, groups, strict=True)):
        if n != len(layout):
            return f"group {g} has {n} data references; the engine's has {len(layout)}"
        if counts[g] < 0 or (counts[g] and not layout):
            return f"group {g}: {counts[g]} blocks over {len(layout)} data references"
    expected = sum(c * n for c, n in zip(counts, refs, strict=True))
    if num_ptrs != expected or num_sizes != expected:
        return f"{num_ptrs} pointers and {num_sizes} sizes where the groups need {expected}"
    return None


def _rows(
    ptrs: np.ndarray[Any, Any], sizes: np.ndarray[Any, Any], kv: KVTensor, ref: GroupRef
) -> tuple[np.ndarray[Any, np.dtype[np.int64]], str | None]:
    """The rows of `kv` that `ptrs` point at, or a problem: a pointer off the tensor or off a
    row's start, or a size other than the reference's page."""
    empty = np.empty(0, dtype=np.int64)
    if not np.all(sizes == ref.nbytes):
        return empty, f"a size is not the page size {ref.nbytes}"
    tensor = kv.tensor
    base = tensor.data_ptr()
    stride = tensor.stride(0) * tensor.element_size()
    rows = int(tensor.shape[0])
    if stride < ref.nbytes:  # rows that overlap (a broadcast view): no pointer names one row
        return empty, f"its KV tensor's rows are {stride} bytes apart, under a page"
    if np.any(ptrs < base):
        return empty, "a pointer lies before its KV tensor"
    offsets = ptrs - np.uint64(base)
    found = offsets // np.uint64(stride)
    if np.any(offsets % np.uint64(stride)):
        return empty, "a pointer is not at the start of a block"
    if np.any(found >= rows):
        return empty, "a pointer lies past its KV tensor"
    return found.astype(np.int64), None
