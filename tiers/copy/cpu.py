"""The CPU copy engine: vLLM's CPU platform, and every CPU test."""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from tiering import gil
from tiers.copy.base import CopyEngine, CopyJob, CopyResult, Direction, KVTensor, LaneMarks
from tiers.copy.mapping import GroupRef
from tiers.native import load_function

if TYPE_CHECKING:
    import torch

__all__ = ["CpuCopyEngine"]

log = logging.getLogger(__name__)

_memmove = ctypes.memmove  # a foreign call: releases the GIL while it copies


_copy_batch: Callable[..., None] | None = load_function(
    "tiers.copy._hostcopy",
    "kvtier_copy_batch",
    [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t],
    None,
    "copies fall back to one memmove per piece, which waits for the GIL between pieces",
)


class _Lane:
    """A queue of copy jobs and the thread that copies them in order (worker process; guarded
    by the engine's condition). Each job comes with the submission number of the other lane's
    newest job it must follow; `done` is the number of this lane's last finished job (the lane
    finishes in order, so every earlier job of it has finished too)."""

    def __init__(self, name: str, run: Callable[[_Lane], None], marks: LaneMarks) -> None:
        self.queue: deque[tuple[CopyJob, int]] = deque()
        self.marks = marks
        self.done = 0
        self.running: CopyJob | None = None  # the job being copied
        self.other: _Lane = self  # the engine's other lane, set once both exist
        self.thread = threading.Thread(target=run, args=(self,), name=name, daemon=True)


class CpuCopyEngine(CopyEngine):
    """Copies on background threads of the worker process (the public methods are called from
    the engine's thread): one lane copies stores and loads in submission order across both
    directions, so a load never overtakes the store of its slot; expedited loads have a lane
    of their own, which waits only for the jobs of the first lane they conflict with (and those
    submitted later wait for them): the contract in `tiers.copy.base`.

    Each job becomes address arrays (vectorized), and one call into the compiled helper copies
    every piece (merging neighbours contiguous on both sides), with the GIL released once for
    the whole job: the engine's main thread keeps running Python meanwhile, and a copy that
    handed the GIL back after every piece would wait up to a switch interval (5 ms) each time.
    Plain copies beat torch's int64 `index_select` + `index_copy_`, which need the bytes twice
    (gather into a staging buffer, then scatter) (BENCHMARKS.md, "CPU copy engine vs numpy
    copies of the same bytes").
    """

    def __init__(
        self,
        tensors: Sequence[KVTensor],
        groups: Sequence[Sequence[GroupRef]],
        shard: torch.Tensor,
        blocks_per_chunk: int = 1,
        *,
        fault: Callable[[CopyJob], None] | None = None,
    ) -> None:
        """`fault`, for tests: called before each copy; whatever it raises fails that job."""
        super().__init__(tensors, groups, shard, blocks_per_chunk)
        if shard.device.type != "cpu" or any(kv.tensor.device.type != "cpu" for kv in tensors):
            raise ValueError("CpuCopyEngine copies between CPU tensors only")
        self._fault = fault
        self._cond = threading.Condition()
        self._pending: set[int] = set()
        # The pending jobs `wait` is blocked on; a lane wakes it when the last goes.
        self._awaited: set[int] = set()
        self._results: list[CopyResult] = []
        self._stopping = False
        self._broken: str | None = None
        """Why the engine takes no more jobs although not shut down (a copy thread died)."""
        self._loads = 0
        """Loads queued or being copied: a request waits on each (`tiering.gil`)."""
        self._urgency = gil.Urgency()
        self._lane = _Lane("kvtier-copy", self._run, self.lane_marks())
        self._expedited = _Lane("kvtier-copy-expedited", self._run, self.lane_marks())
        self._lane.other, self._expedited.other = self._expedited, self._lane
        for lane in (self._lane, self._expedited):
            lane.thread.start()

    def _submit(self, job: CopyJob) -> None:
        with self._cond:
            if self._stopping or self._broken is not None:
                why = self._broken or "engine is shut down"
                self._results.append(CopyResult(job.job_id, job.direction, False, 0, 0.0, why))
                return
            lane = self._expedited if job.expedited else self._lane
            lane.queue.append((job, lane.other.marks.after(job)))
            lane.marks.mark(job)
            self._pending.add(job.job_id)
            if job.direction is Direction.LOAD:
                self._loads += 1
                self._urgency.set(True)
            self._cond.notify_all()

    def get_finished(self) -> list[CopyResult]:
        with self._cond:
            if not self._stopping and not self._lanes_alive():
                self._fail_pending("copy thread died")  # only if a thread was killed
            results, self._results = self._results, []
        for result in results:
            self._reported(result.job_id)
        return results

    def wait(self, job_ids: Iterable[int]) -> None:
        with self._cond:
            self._awaited = self._pending.intersection(job_ids)
            while self._awaited:
                if not self._lanes_alive():
                    self._fail_pending("copy thread died")  # only if a thread was killed
                    if not self._awaited:
                        return
                self._cond.wait(timeout=1.0)

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for lane in (self._lane, self._expedited):
            lane.thread.join()
        self._urgency.set(False)

    def _lanes_alive(self) -> bool:
        return self._lane.thread.is_alive() and self._expedited.thread.is_alive()

    def _ready(self, lane: _Lane) -> bool:
        """The lane's first job may start: the other lane's jobs it must follow have finished."""
        return bool(lane.queue) and lane.queue[0][1] <= lane.other.done

    def _run(self, lane: _Lane) -> None:
        while True:
            with self._cond:
                while not self._ready(lane) and not (self._stopping and not lane.queue):
                    self._cond.wait()
                if not lane.queue:
                    return
                job, _ = lane.queue.popleft()
                lane.running = job
            result = self._execute(job)
            with self._cond:
                lane.running = None
                if job.direction is Direction.LOAD:
                    self._loads -= 1
                    self._urgency.set(self._loads > 0)
                lane.done = job.seq
                self._results.append(result)
                self._pending.discard(job.job_id)
                self._awaited.discard(job.job_id)
                self._cond.notify_all()  # `wait`, and the other lane's jobs that waited for it

    def _execute(self, job: CopyJob) -> CopyResult:
        start = time.perf_counter()
        try:
            if self._fault is not None:
                self._fault(job)
            pieces = self.pieces(job, self.plan(job))
            if _copy_batch is not None and pieces.segments:
                src, dst, nbytes = pieces.flat()
                _copy_batch(src.ctypes.data, dst.ctypes.data, nbytes.ctypes.data, len(src))
            else:
                for src_list, dst_list, size in pieces.segments:
                    _copy(src_list.tolist(), dst_list.tolist(), size)
        except Exception as e:  # any failure is this job's, reported as data
            log.warning("copy job %d (%s) failed: %s", job.job_id, job.direction.value, e)
            return CopyResult(
                job.job_id, job.direction, False, 0, time.perf_counter() - start, repr(e)
            )
        return CopyResult(
            job.job_id, job.direction, True, pieces.total, time.perf_counter() - start
        )

    def _fail_pending(self, why: str) -> None:
        """A copy thread died (only a BaseException that `_execute` does not catch can do it):
        fail every queued job, and the job the dead thread was copying, which will never
        report; a job still being copied by the live lane reports as usual. Later jobs fail
        at once: what is queued behind a dead lane would wait for it forever. Idempotent."""
        self._broken = why
        for lane in (self._lane, self._expedited):
            for job, _ in lane.queue:
                self._results.append(CopyResult(job.job_id, job.direction, False, 0, 0.0, why))
            lane.queue.clear()
            if lane.running is not None and not lane.thread.is_alive():
                job, lane.running = lane.running, None
                self._results.append(CopyResult(job.job_id, job.direction, False, 0, 0.0, why))
        running = [lane.running for lane in (self._lane, self._expedited) if lane.running]
        self._pending = {job.job_id for job in running}
        self._awaited &= self._pending
        self._loads = sum(job.direction is Direction.LOAD for job in running)
        self._urgency.set(self._loads > 0)
        self._cond.notify_all()  # the live lane's thread, if it waits for the dead one


def _copy(src: list[int], dst: list[int], nbytes: int) -> None:
    """memmove `nbytes` per piece, merging neighbours that are contiguous on both sides into
    one call (consecutive blocks into consecutive sub-blocks of a slot, typically)."""
    run_src = run_dst = run_len = 0
    for s, d in zip(src, dst, strict=True):
        if s == run_src + run_len and d == run_dst + run_len:
            run_len += nbytes
            continue
        if run_len:
            _memmove(run_dst, run_src, run_len)
        run_src, run_dst, run_len = s, d, nbytes
    if run_len:
        _memmove(run_dst, run_src, run_len)
