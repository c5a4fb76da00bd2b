"""The CUDA copy engine: GPU KV cache <-> the (pinned) primary region, on CUDA streams.

Only constructed on a machine with CUDA, or over a fake `CudaApi` in tests; importing this module
needs neither CUDA nor torch.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tiers.copy.base import CopyEngine, CopyJob, CopyResult, Direction, KVTensor, Pieces
from tiers.copy.cuda_api import CudaApi, TorchCuda
from tiers.copy.cuda_driver import CudaDriver
from tiers.copy.mapping import GroupRef

if TYPE_CHECKING:
    import torch

__all__ = ["CudaCopyEngine", "CudaDriver"]

log = logging.getLogger(__name__)

_LANES = ("store", "load", "expedited")
_STREAM_DRAWS = 64
"""Streams drawn per lane before settling for one that another user shares: torch hands them
out round-robin from a pool of 32 per priority (`getStreamFromPool`)."""


def _lane(job: CopyJob) -> str:
    if job.direction is Direction.STORE:
        return "store"
    return "expedited" if job.expedited else "load"


@dataclass
class _InFlight:
    """A job queued on its stream and not yet reported (worker process, engine thread).
    `error`: it failed (part of its copies may have been queued: it is reported when `end`,
    recorded after them, completes, so nothing of it still runs by then)."""

    job: CopyJob
    start: Any  # CudaEvent
    end: Any
    nbytes: int
    error: str | None = None


class CudaCopyEngine(CopyEngine):
    """Copies on CUDA streams: worker process, called from the engine's thread.

    - One stream per lane: stores, loads, expedited loads (`tiers.copy.base`), so the jobs of a
      lane run and finish in submission order; lanes overlap each other and the forward pass.
      The three streams differ from each other and from the compute stream where the pool
      allows.
    - Every job first waits on an event recorded on the compute stream at submission, never on
      a device-wide synchronize: a store reads KV written by kernels queued there, and a load
      must land after what is queued there for its blocks (vLLM zeroes new blocks there).
    - A job waits, in each other lane, on the end event of the newest in-flight job it
      conflicts with (`LaneMarks`: a store writing a slot a load reads, a load writing an
      engine block a store reads, ...); within a lane, stream order does it.
    - A job is one `cuMemcpyBatchAsync` (CUDA >= 12.8), or a `cuMemcpyAsync` per piece where
      the batch call is missing or fails its start-up self-check. A load's host source is read
      out of stream order (ANY) only when the shard is pinned and the load waits for no
      in-flight store: ANY lets the driver read the source from the call on, before the store
      it waits for has written it. Everything else is read in stream order.
    - A copy that fails after part of it was queued still records its end event, and the job
      is reported failed when that completes. An error CUDA reports later (on `query`,
      `elapsed_time`, `synchronize`) fails the job it was reported for.
    - Events come from a pool and go back to it once their job is reported.
    - The host side should be registered with the driver (`PrimaryRegion.pin`): unpinned,
      copies are staged by the driver and a store may block the caller until the compute stream
      reaches it (CUDA's "API synchronization behavior" for pageable memory). `pinned` says
      which (None: ask CUDA about the shard).
    - `cuda`: the seam (`tiers.copy.cuda_api`); None is torch on the KV tensors' device.
    """

    def __init__(
        self,
        tensors: Sequence[KVTensor],
        groups: Sequence[Sequence[GroupRef]],
        shard: torch.Tensor,
        blocks_per_chunk: int = 1,
        *,
        batch: bool = True,
        fault: Callable[[CopyJob], None] | None = None,
        pinned: bool | None = None,
        cuda: CudaApi | None = None,
    ) -> None:
        super().__init__(tensors, groups, shard, blocks_per_chunk)
        if cuda is None:
            cuda = TorchCuda(self.tensors[0].tensor.device)
        if not cuda.is_device(self.tensors[0].tensor) or shard.device.type != "cpu":
            raise ValueError("CudaCopyEngine copies between CUDA KV tensors and a host shard")
        self._cuda = cuda
        self._driver = cuda.driver
        self._fault = fault
        self.pinned = cuda.is_pinned(shard) if pinned is None else pinned
        if not self.pinned:
            log.warning(
                "CUDA copy engine: the primary region is not pinned; copies are staged through "
                "pageable memory (slower, and a store may block its caller)"
            )
        self._streams = self._lane_streams()
        self._events: list[Any] = []
        self._ready: list[Any] = []
        self._inflight: dict[str, deque[_InFlight]] = {lane: deque() for lane in _LANES}
        self._marks = {lane: self.lane_marks() for lane in _LANES}
        self._failed: list[CopyResult] = []
        self._closed = False
        self.batched = batch and self._driver.has_batch and self._batch_self_check()
        log.info(
            "CUDA copy engine on device %d: %s copies (%s), %s region",
            cuda.device_index,
            "batched" if self.batched else "per-piece",
            self._driver.batch_symbol or "no batch call",
            "pinned" if self.pinned else "pageable",
        )

    def _lane_streams(self) -> dict[str, Any]:
        used = {self._cuda.current_stream().cuda_stream}
        streams = {}
        for lane in _LANES:
            for _ in range(_STREAM_DRAWS):
                stream = self._cuda.stream()
                if stream.cuda_stream not in used:
                    break
            else:
                log.warning("CUDA copy engine: the %s lane shares its stream with others", lane)
            used.add(stream.cuda_stream)
            streams[lane] = stream
        return streams

    def _event(self) -> Any:
        return self._events.pop() if self._events else self._cuda.event(True)

    def _submit(self, job: CopyJob) -> None:
        if self._closed:
            self._fail(job, "engine is shut down")
            return
        lane = _lane(job)
        stream = self._streams[lane]
        try:
            if self._fault is not None:
                self._fault(job)
            pieces = self.pieces(job, self.plan(job))
            ready = self._ready.pop() if self._ready else self._cuda.event(False)
            ready.record(self._cuda.current_stream())
            stream.wait_event(ready)
            self._ready.append(ready)  # reusable at once: wait_event captured it
            behind_store = False
            for other, queue in self._inflight.items():
                if other == lane:
                    continue
                after = self._marks[other].after(job)
                newest = None
                for item in queue:  # in submission order: the first few are the candidates
                    if item.job.seq > after:
                        break
                    newest = item
                if newest is not None:
                    stream.wait_event(newest.end)
                    behind_store = behind_store or other == "store"
            self._marks[lane].mark(job)
            start, end = self._event(), self._event()
            start.record(stream)
        except Exception as e:  # reported as a failed job, never raised into the engine
            self._fail(job, repr(e))
            return
        error = None
        try:
            self._copy(pieces, job.direction, stream, self.pinned and not behind_store)
        except Exception as e:  # part of it may be queued: reported once `end` completes
            log.warning("copy job %d (%s) failed: %s", job.job_id, job.direction.value, e)
            error = repr(e)
        try:
            end.record(stream)
        except Exception as e:
            self._fail(job, repr(e))
            return
        self._inflight[lane].append(_InFlight(job, start, end, pieces.total, error))

    def _fail(self, job: CopyJob, why: str) -> None:
        log.warning("copy job %d (%s) failed: %s", job.job_id, job.direction.value, why)
        self._failed.append(CopyResult(job.job_id, job.direction, False, 0, 0.0, why))

    def _copy(self, pieces: Pieces, direction: Direction, stream: Any, src_any: bool) -> None:
        if not pieces.segments:
            return
        handle = stream.cuda_stream
        if self.batched:
            src, dst, sizes = pieces.flat()
            to_device = direction is Direction.LOAD
            self._driver.memcpy_batch(
                dst, src, sizes, to_device and src_any, self._cuda.device_index, to_device, handle
            )
            return
        memcpy = self._driver.memcpy
        for src_arr, dst_arr, nbytes in pieces.segments:
            for s, d in zip(src_arr.tolist(), dst_arr.tolist(), strict=True):
                memcpy(d, s, nbytes, handle)

    def get_finished(self) -> list[CopyResult]:
        results, self._failed = self._failed, []
        for queue in self._inflight.values():
            while queue:
                item = queue[0]
                seconds = 0.0
                try:
                    if not item.end.query():
                        break
                    if item.error is None:
                        seconds = item.start.elapsed_time(item.end) / 1e3
                except Exception as e:  # an asynchronous CUDA error: this job's failure
                    item.error = item.error or repr(e)
                queue.popleft()
                job = item.job
                if item.error is None:
                    results.append(
                        CopyResult(job.job_id, job.direction, True, item.nbytes, seconds)
                    )
                    self._events += (item.start, item.end)
                else:
                    results.append(CopyResult(job.job_id, job.direction, False, 0, 0.0, item.error))
        for result in results:
            self._reported(result.job_id)
        return results

    def wait(self, job_ids: Iterable[int]) -> None:
        wanted = set(job_ids)
        for queue in self._inflight.values():
            for item in queue:
                if item.job.job_id in wanted:
                    try:
                        item.end.synchronize()
                    except Exception as e:  # reported by get_finished as this job's failure
                        item.error = item.error or repr(e)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for lane, stream in self._streams.items():
            try:
                stream.synchronize()
            except Exception as e:  # the context is lost: nothing of ours runs on it any more
                log.warning("CUDA copy engine: the %s lane ended with an error: %s", lane, e)

    def _batch_self_check(self) -> bool:
        """Copy a few pieces both ways with the batch call and compare; False (and per-piece
        copies from then on) on any mismatch or error of its own. A CUDA error left pending on
        this thread by an earlier call surfaces at the check's first kernel launch, which
        clears it: it is logged as what it is, and the check goes on."""
        import torch

        cuda = self._cuda
        n = 4096
        pattern = torch.arange(4 * n, dtype=torch.int32).view(torch.uint8)
        try:
            device = cuda.to_device(pattern)
        except Exception as e:
            log.warning(
                "a CUDA error was pending on this thread before the copy engine started (%s): "
                "an earlier call's, not cuMemcpyBatchAsync's",
                e,
            )
            try:
                device = cuda.to_device(pattern)
            except Exception as again:
                log.warning("CUDA copy engine self-check: %s; copying piece by piece", again)
                return False
        try:
            host = cuda.host_buffer(4 * n * 4)
            stream = cuda.stream()
            src = np.array([device.data_ptr() + i * n for i in (3, 0, 2)], dtype=np.int64)
            dst = np.array([host.data_ptr() + i * n for i in (0, 1, 2)], dtype=np.int64)
            sizes = np.full(3, n, dtype=np.int64)
            cuda.synchronize()  # the device copy has landed before another stream reads it
            self._driver.memcpy_batch(
                dst, src, sizes, False, cuda.device_index, False, stream.cuda_stream
            )
            stream.synchronize()
            flat = pattern.view(torch.uint8)
            expected = torch.cat([flat[3 * n : 4 * n], flat[0:n], flat[2 * n : 3 * n]])
            ok = bool(torch.equal(host[: 3 * n], expected))
            back = cuda.to_device(torch.zeros(4 * n, dtype=torch.uint8))
            cuda.synchronize()  # the zeros have landed before the batch writes over them
            self._driver.memcpy_batch(
                np.array([back.data_ptr() + n], dtype=np.int64),
                np.array([host.data_ptr()], dtype=np.int64),
                np.array([n], dtype=np.int64),
                True,
                cuda.device_index,
                True,
                stream.cuda_stream,
            )
            stream.synchronize()
            ok = ok and bool(torch.equal(back[n : 2 * n].cpu(), flat[3 * n : 4 * n]))
        except Exception as e:
            log.warning("cuMemcpyBatchAsync self-check failed (%s); copying piece by piece", e)
            return False
        if not ok:
            log.warning("cuMemcpyBatchAsync self-check copied wrong bytes; copying piece by piece")
        return ok
