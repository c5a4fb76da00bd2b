"""The copy-engine contract (worker side): jobs that move blocks between the inference engine's
KV cache and the worker's shard of the primary region.

- A store (engine blocks -> slots) or a load (slots -> engine blocks) is submitted as a job and
  returns at once; the copy runs in the background (a thread on CPU, streams on CUDA).
- `get_finished()` returns the jobs finished since the last call, without blocking. Every job
  is reported exactly once, with its bytes and seconds, including jobs someone `wait`ed for.
- `wait(job_ids)` blocks until those jobs are finished (loads included); unknown or already
  finished ids are ignored.
- Jobs of one direction finish in submission order, and a load never reads a slot before the
  store that writes it (submitted earlier) has finished.
- An expedited load (vLLM 0.33 waits for it inside the step, before the forward pass) has a lane
  of its own: it does not queue behind earlier stores or loads, and may finish before them. It
  still waits for every earlier job of another lane it conflicts with, and a later job for an
  expedited load it conflicts with, so lanes never reorder two copies of the same bytes. Two
  jobs conflict when one writes what the other reads or writes: a store writes slots and reads
  engine blocks, a load the other way round (two loads of one slot do not conflict). Which
  earlier job a new one must follow is found in time proportional to the new job's size
  (`LaneMarks`), never to what is queued.
- A failed copy (bad ids, a driver error, an injected fault) is a failed job, never an
  exception raised into the engine. Misusing the contract (a job id twice) raises StateError.
"""

from __future__ import annotations

import enum
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tiers.copy.mapping import EngineBlocks, GroupRef, IntArray, TensorRows, plan_copy

if TYPE_CHECKING:
    import torch

__all__ = ["CopyEngine", "CopyResult", "Direction", "CopyJob", "KVTensor", "LaneMarks", "Pieces"]

log = logging.getLogger(__name__)


class Direction(enum.Enum):
    """Which way a copy job moves bytes (any thread: a value)."""

    STORE = "store"
    """Engine KV cache -> primary slots."""
    LOAD = "load"
    """Primary slots -> engine KV cache."""


@dataclass(frozen=True, slots=True)
class KVTensor:
    """One KV-cache tensor of the engine (worker process): `(num_blocks, row_bytes)` bytes, a
    block per row (vLLM's `CanonicalKVCacheTensor`). `page_bytes` is what a block of it takes
    in a slot: the padded page, at most the row."""

    tensor: torch.Tensor
    page_bytes: int


@dataclass(frozen=True, slots=True)
class CopyResult:
    """A finished copy job as `get_finished` reports it (worker process, any thread: a value)."""

    job_id: int
    direction: Direction
    ok: bool
    nbytes: int
    seconds: float
    error: str | None = None


@dataclass(frozen=True, slots=True)
class CopyJob:
    """One submitted copy (worker process: built on the engine's thread, copied on the
    engine's own thread or streams): the blocks and slots of a store or a load."""

    job_id: int
    direction: Direction
    blocks: EngineBlocks
    slots: IntArray
    expedited: bool = False
    seq: int = 0
    """The engine's submission number of the job (from 1): unlike job ids, never reused."""
    in_range: bool = True
    """Every slot and engine block id is within the engine's bounds (else the job fails
    when it is planned, touching nothing, and no other job waits for it)."""


class LaneMarks:
    """For one lane of a copy engine: per slot and per engine block, the submission number
    of the lane's newest job that writes it and that reads it (worker process, under the
    engine's lock or on the engine's thread). A lane finishes its jobs in order, so a job of
    another lane that conflicts with some of them need only follow the newest (`after`)."""

    def __init__(self, num_slots: int, num_blocks: int) -> None:
        self.slot_written = np.zeros(num_slots, dtype=np.int64)
        self.slot_read = np.zeros(num_slots, dtype=np.int64)
        self.block_written = np.zeros(num_blocks, dtype=np.int64)
        self.block_read = np.zeros(num_blocks, dtype=np.int64)

    def after(self, job: CopyJob) -> int:
        """The submission number of this lane's newest job that `job` must follow (0: none)."""
        if not job.in_range:
            return 0
        slots, blocks = job.slots, job.blocks.block_ids
        if job.direction is Direction.STORE:  # writes slots, reads blocks
            marks = (self.slot_read[slots], self.slot_written[slots], self.block_written[blocks])
        else:  # reads slots, writes blocks
            marks = (self.slot_written[slots], self.block_read[blocks], self.block_written[blocks])
        return max(int(m.max(initial=0)) for m in marks)

    def mark(self, job: CopyJob) -> None:
        """`job` is this lane's newest."""
        if not job.in_range:
            return
        if job.direction is Direction.STORE:
            self.slot_written[job.slots] = job.seq
            self.block_read[job.blocks.block_ids] = job.seq
        else:
            self.slot_read[job.slots] = job.seq
            self.block_written[job.blocks.block_ids] = job.seq


@dataclass(frozen=True, slots=True)
class Pieces:
    """The byte copies of one job, per KV tensor: `nbytes` from each `src[i]` to `dst[i]`
    (worker process, any thread: a value)."""

    segments: list[tuple[IntArray, IntArray, int]]

    @property
    def total(self) -> int:
        return sum(len(src) * nbytes for src, _, nbytes in self.segments)

    def flat(self) -> tuple[IntArray, IntArray, IntArray]:
        """Sources, destinations and sizes of every piece as three int64 arrays."""
        if len(self.segments) == 1:
            src, dst, nbytes = self.segments[0]
            return src, dst, np.full(len(src), nbytes, dtype=np.int64)
        return (
            np.concatenate([s for s, _, _ in self.segments]),
            np.concatenate([d for _, d, _ in self.segments]),
            np.concatenate([np.full(len(s), n, dtype=np.int64) for s, _, n in self.segments]),
        )


class CopyEngine(ABC):
    """Base of the copy engines: worker process; `submit_*`, `get_finished`, `wait` and
    `shutdown` are called from the engine's thread.

    Geometry (validated here, shared by the engines): tensor t's blocks sit in each slot of the
    worker's shard at `offset[t] + j * page_bytes[t]` for sub-block j < blocks_per_chunk, with
    the tensors in order.
    """

    def __init__(
        self,
        tensors: Sequence[KVTensor],
        groups: Sequence[Sequence[GroupRef]],
        shard: torch.Tensor,
        blocks_per_chunk: int = 1,
    ) -> None:
        if blocks_per_chunk <= 0:
            raise ValueError(f"blocks_per_chunk must be positive, got {blocks_per_chunk}")
        if shard.dim() != 2 or shard.element_size() != 1 or shard.stride(1) != 1:
            raise ValueError("the shard must be a (num_slots, shard_bytes) byte tensor")
        self.tensors = list(tensors)
        self.groups = [list(refs) for refs in groups]
        self.shard = shard
        self.blocks_per_chunk = blocks_per_chunk
        self.num_slots = int(shard.shape[0])
        self.slot_stride = int(shard.stride(0))
        offsets, offset = [], 0
        for t, kv in enumerate(self.tensors):
            if kv.tensor.dim() != 2 or kv.tensor.stride(1) != 1:
                raise ValueError(f"KV tensor {t} must be (num_blocks, row) with rows contiguous")
            row_bytes = kv.tensor.shape[1] * kv.tensor.element_size()
            if not 0 < kv.page_bytes <= row_bytes:
                raise ValueError(
                    f"KV tensor {t}: page of {kv.page_bytes} bytes, rows of {row_bytes}"
                )
            offsets.append(offset)
            offset += kv.page_bytes * blocks_per_chunk
        if offset > shard.shape[1]:
            raise ValueError(
                f"the KV tensors take {offset} bytes per slot ({blocks_per_chunk} blocks each); "
                f"the shard has {shard.shape[1]}"
            )
        for g, refs in enumerate(self.groups):
            for ref in refs:
                if not 0 <= ref.tensor_index < len(self.tensors):
                    raise ValueError(f"group {g} refers to KV tensor {ref.tensor_index}")
                if not 0 < ref.nbytes <= self.tensors[ref.tensor_index].page_bytes:
                    raise ValueError(f"group {g}: {ref.nbytes} bytes do not fit the tensor's page")
        # Per tensor: where its rows start and how far apart they are (engine side), and where
        # its part of slot 0 starts (slot side).
        self._engine_base = [kv.tensor.data_ptr() for kv in self.tensors]
        self._engine_stride = [
            kv.tensor.stride(0) * kv.tensor.element_size() for kv in self.tensors
        ]
        self._slot_base = [shard.data_ptr() + offset for offset in offsets]
        self._num_blocks = min((int(kv.tensor.shape[0]) for kv in self.tensors), default=0)
        self._known: set[int] = set()  # submitted and not yet reported
        self._seq = 0  # submissions so far

    def submit_store(self, job_id: int, blocks: EngineBlocks, slots: Sequence[int] | Any) -> None:
        """Copy `blocks` of the engine's KV cache into `slots` (in the background). The arrays
        are the engine's until the job is reported: do not change them before."""
        self._submit(self._job(job_id, Direction.STORE, blocks, slots))

    def submit_load(
        self,
        job_id: int,
        slots: Sequence[int] | Any,
        blocks: EngineBlocks,
        *,
        expedited: bool = False,
    ) -> None:
        """Copy `slots` into `blocks` of the engine's KV cache (in the background).
        `expedited`: in the lane of its own (the module's contract), for a load the engine
        waits for before its next forward pass."""
        self._submit(self._job(job_id, Direction.LOAD, blocks, slots, expedited))

    @abstractmethod
    def get_finished(self) -> list[CopyResult]:
        """Jobs finished since the last call, each exactly once. Never blocks."""

    @abstractmethod
    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until every known job among `job_ids` has finished (it is still reported)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Finish or fail what is in flight and release resources. Idempotent."""

    @abstractmethod
    def _submit(self, job: CopyJob) -> None: ...

    def _job(
        self,
        job_id: int,
        direction: Direction,
        blocks: EngineBlocks,
        slots: Any,
        expedited: bool = False,
    ) -> CopyJob:
        from tiering.errors import StateError

        if job_id in self._known:
            raise StateError(f"copy job {job_id} was submitted twice")
        self._known.add(job_id)
        # No copies: the caller hands the arrays over and must not change them until the job
        # is reported (vLLM builds fresh ones per transfer).
        ids = np.asarray(blocks.block_ids, dtype=np.int64)
        slot_ids = np.asarray(slots, dtype=np.int64).reshape(-1)
        self._seq += 1
        return CopyJob(
            job_id,
            direction,
            EngineBlocks(ids, blocks.group_sizes, blocks.block_indices),
            slot_ids,
            expedited,
            self._seq,
            _within(ids, self._num_blocks) and _within(slot_ids, self.num_slots),
        )

    def lane_marks(self) -> LaneMarks:
        """Fresh marks for one lane of this engine."""
        return LaneMarks(self.num_slots, self._num_blocks)

    def _reported(self, job_id: int) -> None:
        self._known.discard(job_id)

    def plan(self, job: CopyJob) -> list[TensorRows]:
        """The copies of a job, bounds-checked against this engine's tensors and slots."""
        ids, slots = job.blocks.block_ids, job.slots
        if len(ids) and (ids.min() < 0 or ids.max() >= self._num_blocks):
            raise ValueError(f"engine block id out of range 0..{self._num_blocks - 1}")
        if len(slots) and (slots.min() < 0 or slots.max() >= self.num_slots):
            raise ValueError(f"slot out of range 0..{self.num_slots - 1}")
        return plan_copy(job.blocks, slots, self.blocks_per_chunk, self.groups)

    def pieces(self, job: CopyJob, rows: list[TensorRows]) -> Pieces:
        """Addresses of every copy of a job, in plan order (engine side: the tensors' own
        addresses, host or device)."""
        bpc = self.blocks_per_chunk
        store = job.direction is Direction.STORE
        segments = []
        for r in rows:
            t = r.tensor_index
            engine = self._engine_base[t] + r.engine_rows * self._engine_stride[t]
            if bpc == 1:
                slot = self._slot_base[t] + r.slot_rows * self.slot_stride
            else:
                index, sub = np.divmod(r.slot_rows, bpc)
                slot = (
                    self._slot_base[t] + index * self.slot_stride + sub * self.tensors[t].page_bytes
                )
            segments.append((engine, slot, r.nbytes) if store else (slot, engine, r.nbytes))
        return Pieces(segments)


def _within(ids: IntArray, bound: int) -> bool:
    return not len(ids) or (int(ids.min()) >= 0 and int(ids.max()) < bound)
