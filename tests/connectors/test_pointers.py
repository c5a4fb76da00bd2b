"""vLLM 0.34's device pointers resolved back to the copy engine's block ids
(`connectors.vllm.pointers`), checked on the way: every pointer on a row of the tensor its data
reference names, the references of a group naming the same rows, every size its page; a pointer
that is not is a failed job that copies nothing. No vLLM needed: the pointers are made the way
vLLM 0.34's `resolve_device_pointers` makes them."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from connectors.vllm.pointers import INVALID, blocks_from_pointers
from tiers.copy import CpuCopyEngine, EngineBlocks, GroupRef, KVTensor

NUM_BLOCKS = 16
PAGES = (256, 128)
"""Tensor 0's page (group 0, referenced twice: aliased layers) and tensor 1's (group 1)."""


@dataclass
class Pointers:
    """vLLM 0.34's `DevicePointers`, field for field."""

    ptrs: np.ndarray[Any, Any]
    sizes: np.ndarray[Any, Any]
    group_block_counts: tuple[int, ...]
    group_data_ref_counts: tuple[int, ...]
    block_indices: tuple[int, ...]


def layout() -> tuple[list[KVTensor], list[list[GroupRef]]]:
    gen = torch.Generator().manual_seed(0)
    tensors = []
    for page in PAGES:  # rows padded beyond the page, as vLLM's views may be
        rows = torch.randint(-128, 127, (NUM_BLOCKS, page + 32), dtype=torch.int8, generator=gen)
        tensors.append(KVTensor(rows[:, :page], page))
    return tensors, [[GroupRef(0, 256), GroupRef(0, 256)], [GroupRef(1, 100)]]


def resolve(
    block_ids: list[int],
    counts: list[int],
    indices: list[int],
    tensors: list[KVTensor],
    groups: list[list[GroupRef]],
) -> Pointers:
    """What vLLM 0.34's `resolve_device_pointers` computes: for each group, for each data
    reference, for each block, `data_ptr + block_id * stride(0)` and the unpadded page size."""
    ptrs: list[int] = []
    sizes: list[int] = []
    start = 0
    for count, refs in zip(counts, groups, strict=True):
        ids = block_ids[start : start + count]
        for ref in refs if count else ():
            tensor = tensors[ref.tensor_index].tensor
            ptrs += [tensor.data_ptr() + b * tensor.stride(0) for b in ids]
            sizes += [ref.nbytes] * count
        start += count
    return Pointers(
        np.array(ptrs, dtype=np.uint64),
        np.array(sizes, dtype=np.uint64),
        tuple(counts),
        tuple(len(refs) for refs in groups),
        tuple(indices),
    )


@pytest.mark.parametrize(
    ("block_ids", "counts", "indices"),
    [([3, 7, 1, 15, 0], [3, 2], [0, 4]), ([], [0, 0], [0, 0]), ([5, 9], [0, 2], [0, 3])],
)
def test_pointers_resolve_to_the_blocks_they_were_made_from(
    block_ids: list[int], counts: list[int], indices: list[int]
) -> None:
    tensors, groups = layout()
    pointers = resolve(block_ids, counts, indices, tensors, groups)
    blocks, problem = blocks_from_pointers(pointers, tensors, groups)
    assert problem is None
    assert blocks.block_ids.tolist() == block_ids
    assert (blocks.group_sizes, blocks.block_indices) == (tuple(counts), tuple(indices))


def damaged(
    kind: str, tensors: list[KVTensor], groups: list[list[GroupRef]]
) -> tuple[Pointers, str]:
    pointers = resolve([3, 7, 1, 15, 0], [3, 2], [0, 4], tensors, groups)
    rows0 = tensors[0].tensor
    if kind == "past the tensor":
        pointers.ptrs[1] = rows0.data_ptr() + NUM_BLOCKS * rows0.stride(0)
        return pointers, "a pointer lies past its KV tensor"
    if kind == "before the tensor":
        pointers.ptrs[0] = rows0.data_ptr() - rows0.stride(0)
        return pointers, "a pointer lies before its KV tensor"
    if kind == "inside a block":
        pointers.ptrs[2] += 8
        return pointers, "a pointer is not at the start of a block"
    if kind == "another size":
        pointers.sizes[6] = 128
        return pointers, "group 1, data reference 0: a size is not the page size 100"
    if kind == "references disagree":
        pointers.ptrs[3] = rows0.data_ptr() + 4 * rows0.stride(0)
        return pointers, "group 0: data reference 1 names other blocks than reference 0"
    if kind == "too few pointers":
        pointers.ptrs = pointers.ptrs[:-1]
        return pointers, "7 pointers and 8 sizes where the groups need 8"
    if kind == "other groups":
        pointers.group_data_ref_counts = (2, 2)
        return pointers, "group 1 has 2 data references; the engine's has 1"
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind",
    [
        "past the tensor",
        "before the tensor",
        "inside a block",
        "another size",
        "references disagree",
        "too few pointers",
        "other groups",
    ],
)
def test_a_pointer_that_does_not_resolve_makes_every_block_invalid(kind: str) -> None:
    tensors, groups = layout()
    pointers, problem = damaged(kind, tensors, groups)
    blocks, found = blocks_from_pointers(pointers, tensors, groups)
    assert found is not None and found.endswith(problem)
    assert blocks.block_ids.tolist() == [INVALID] * 5
    assert blocks.group_sizes == pointers.group_block_counts


def finished(engine: CpuCopyEngine, *job_ids: int) -> dict[int, Any]:
    """The results of `job_ids`, once all have finished (at most 10 s)."""
    results: dict[int, Any] = {}
    deadline = time.monotonic() + 10
    while not results.keys() >= set(job_ids):
        if time.monotonic() > deadline:
            raise AssertionError(f"copy jobs {set(job_ids) - results.keys()} did not finish")
        results.update((r.job_id, r) for r in engine.get_finished())
        time.sleep(0.001)
    return results


def test_the_engine_copies_by_resolved_pointers_and_refuses_stray_ones() -> None:
    """A store by pointers moves exactly the bytes of the blocks the pointers name; a store
    and a load whose pointers do not resolve fail as jobs and change no byte anywhere."""
    tensors, groups = layout()
    shard = torch.zeros((8, sum(PAGES)), dtype=torch.uint8)
    engine = CpuCopyEngine(tensors, groups, shard, 1)
    try:
        pointers = resolve([3, 7, 1, 15, 0], [3, 2], [0, 4], tensors, groups)
        blocks, _ = blocks_from_pointers(pointers, tensors, groups)
        engine.submit_store(1, blocks, [0, 1, 2, 3, 4])
        assert finished(engine, 1)[1].ok
        for slot, block in enumerate([3, 7, 1]):
            assert torch.equal(shard[slot, :256], tensors[0].tensor[block].view(torch.uint8))
        for slot, block in zip([3, 4], [15, 0], strict=True):
            assert torch.equal(
                shard[slot, 256 : 256 + 100], tensors[1].tensor[block, :100].view(torch.uint8)
            )

        before_shard = shard.clone()
        before_kv = [kv.tensor.clone() for kv in tensors]
        stray, _ = damaged("past the tensor", tensors, groups)
        bad, problem = blocks_from_pointers(stray, tensors, groups)
        assert problem is not None
        engine.submit_store(2, bad, [5, 6, 7, 0, 1])
        engine.submit_load(3, [0, 1, 2, 3, 4], bad)
        results = finished(engine, 2, 3)
        assert not results[2].ok and not results[3].ok
        assert torch.equal(shard, before_shard)
        assert all(torch.equal(kv.tensor, b) for kv, b in zip(tensors, before_kv, strict=True))
    finally:
        engine.shutdown()


def test_an_empty_transfer_resolves_to_no_block() -> None:
    tensors, groups = layout()
    blocks, problem = blocks_from_pointers(
        resolve([], [0, 0], [0, 0], tensors, groups), tensors, groups
    )
    assert problem is None and isinstance(blocks, EngineBlocks) and len(blocks.block_ids) == 0


def test_a_tensor_whose_rows_overlap_resolves_nothing() -> None:
    """A KV tensor whose rows are less than a page apart (a broadcast or overlapping view) has
    no row a pointer could name: the transfer is refused rather than divided by a zero stride."""
    tensors, groups = layout()
    pointers = resolve([1, 2], [2, 0], [0, 0], tensors, groups)
    flat = KVTensor(torch.zeros(256, dtype=torch.int8).expand(NUM_BLOCKS, 256), 256)
    blocks, problem = blocks_from_pointers(pointers, [flat, tensors[1]], groups)
    assert problem is not None and "under a page" in problem
    assert blocks.block_ids.tolist() == [INVALID, INVALID]
