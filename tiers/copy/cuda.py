"""The CUDA copy engine: GPU KV cache <-> the (pinned) primary region, on CUDA streams.

Only constructed on a machine with CUDA; importing this module needs neither CUDA nor torch.
"""

from __future__ import annotations

import ctypes
import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tiers.copy.base import CopyEngine, CopyJob, CopyResult, Direction, KVTensor, Pieces
from tiers.copy.mapping import GroupRef, IntArray

if TYPE_CHECKING:
    import torch

__all__ = ["CudaCopyEngine", "CudaDriver"]

log = logging.getLogger(__name__)

# CUmemcpySrcAccessOrder and CUmemLocationType (cuda.h, CUDA >= 12.8).
_ORDER_STREAM, _ORDER_ANY = 1, 3
_LOC_DEVICE, _LOC_HOST = 1, 2


class _MemLocation(ctypes.Structure):
    """`CUmemLocation` of the driver API (worker process: passed to the driver)."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    """`CUmemcpyAttributes` of the driver API (worker process: passed to the driver)."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


class CudaDriver:
    """The few CUDA driver calls the engine makes, through ctypes on libcuda (worker process,
    the engine's thread).

    ctypes rather than `cuda.bindings`: the pointer arrays go to the driver as the numpy buffers
    they already are (no per-element conversion), the API did not change shape between
    cuda-python releases, and there is no extra package to install.
    """

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._memcpy_async = lib.cuMemcpyAsync
        self._memcpy_async.argtypes = [
            ctypes.c_uint64,
            ctypes.c_uint64,
            ctypes.c_size_t,
            ctypes.c_void_p,
        ]
        self._memcpy_async.restype = ctypes.c_int
        # CUDA 13 renamed the batch entry point (`_v2`, no failIdx); 12.8 and 12.9 have failIdx.
        self._batch: Any = None
        self._batch_has_fail_idx = False
        for symbol, fail_idx in (("cuMemcpyBatchAsync_v2", False), ("cuMemcpyBatchAsync", True)):
            fn = getattr(lib, symbol, None)
            if fn is None:
                continue
            args = [
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.POINTER(_MemcpyAttributes),
                ctypes.c_void_p,
                ctypes.c_size_t,
            ]
            fn.argtypes = (
                [*args, ctypes.c_void_p, ctypes.c_void_p] if fail_idx else [*args, ctypes.c_void_p]
            )
            fn.restype = ctypes.c_int
            self._batch, self._batch_has_fail_idx = fn, fail_idx
            break

    @property
    def has_batch(self) -> bool:
        return self._batch is not None

    def memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        err = self._memcpy_async(dst, src, nbytes, stream)
        if err:
            raise OSError(f"cuMemcpyAsync failed with CUresult {err}")

    def memcpy_batch(
        self,
        dst: IntArray,
        src: IntArray,
        nbytes: IntArray,
        src_any: bool,
        device: int,
        to_device: bool,
        stream: int,
    ) -> None:
        """One `cuMemcpyBatchAsync` for every piece; the source may be read out of stream order
        (`src_any`: host slots that nothing else writes meanwhile) or in stream order."""
        count = len(dst)
        host, dev = _MemLocation(_LOC_HOST, 0), _MemLocation(_LOC_DEVICE, device)
        attrs = _MemcpyAttributes(
            _ORDER_ANY if src_any else _ORDER_STREAM,
            host if to_device else dev,
            dev if to_device else host,
            0,
        )
        dst_u = np.ascontiguousarray(dst, dtype=np.uint64)
        src_u = np.ascontiguousarray(src, dtype=np.uint64)
        size_u = np.ascontiguousarray(nbytes, dtype=np.uint64)
        attr_idx = np.zeros(1, dtype=np.uint64)
        args: list[Any] = [
            dst_u.ctypes.data,
            src_u.ctypes.data,
            size_u.ctypes.data,
            count,
            ctypes.byref(attrs),
            attr_idx.ctypes.data,
            1,
        ]
        if self._batch_has_fail_idx:
            fail = ctypes.c_size_t(0)
            args.append(ctypes.addressof(fail))
        err = self._batch(*args, stream)
        if err:
            raise OSError(f"cuMemcpyBatchAsync failed with CUresult {err}")


_LANES = ("store", "load", "expedited")


def _lane(job: CopyJob) -> str:
    if job.direction is Direction.STORE:
        return "store"
    return "expedited" if job.expedited else "load"


@dataclass
class _InFlight:
    """A job queued on its stream and not yet reported (worker process, engine thread)."""

    job: CopyJob
    start: Any  # torch.cuda.Event
    end: Any
    nbytes: int
    slots: IntArray


class CudaCopyEngine(CopyEngine):
    """Copies on CUDA streams: worker process, called from the engine's thread.

    - One stream per lane: stores, loads, expedited loads (`tiers.copy.base`), so the jobs of a
      lane run and finish in submission order; lanes overlap each other and the forward pass.
    - A store first waits on an event recorded on the compute stream at submission (the KV it
      reads is written by kernels queued there), never on a device-wide synchronize.
    - A job waits, in each other lane, on the end event of the newest in-flight job it
      conflicts with (a store writing a slot a load reads, a load writing an engine block a
      store reads, or the other way round); within a lane, stream order does it.
    - A job is one `cuMemcpyBatchAsync` (CUDA >= 12.8; source order ANY for slot -> GPU, STREAM
      for GPU -> slot), or a `cuMemcpyAsync` per piece where the batch call is missing or fails
      its start-up self-check.
    - Events come from a pool and go back to it once their job is reported.
    - The host side must be registered with the driver (`PrimaryRegion.pin`) for the copies to
      be asynchronous DMA.
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
    ) -> None:
        import torch

        super().__init__(tensors, groups, shard, blocks_per_chunk)
        self.device = self.tensors[0].tensor.device
        if self.device.type != "cuda" or shard.device.type != "cpu":
            raise ValueError("CudaCopyEngine copies between CUDA KV tensors and a host shard")
        self._torch = torch
        self._fault = fault
        self._driver = CudaDriver()
        self._streams = {lane: torch.cuda.Stream(self.device) for lane in _LANES}  # type: ignore[no-untyped-call]
        self._events: list[Any] = []
        self._inflight: dict[str, deque[_InFlight]] = {lane: deque() for lane in _LANES}
        self._failed: list[CopyResult] = []
        self.batched = batch and self._driver.has_batch and self._batch_self_check()
        log.info(
            "CUDA copy engine on %s: %s copies",
            self.device,
            "batched" if self.batched else "per-piece",
        )

    def _event(self) -> Any:
        if self._events:
            return self._events.pop()
        return self._torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]

    def _submit(self, job: CopyJob) -> None:
        torch = self._torch
        try:
            if self._fault is not None:
                self._fault(job)
            pieces = self.pieces(job, self.plan(job))
            lane = _lane(job)
            stream = self._streams[lane]
            if job.direction is Direction.STORE:
                ready = self._event()
                ready.record(torch.cuda.current_stream(self.device))
                stream.wait_event(ready)
                self._events.append(ready)  # reusable at once: wait_event captured it
            for other, queue in self._inflight.items():
                if other == lane:
                    continue
                for item in reversed(queue):
                    if job.conflicts(item.job):
                        stream.wait_event(item.end)
                        break
            start, end = self._event(), self._event()
            start.record(stream)
            self._copy(pieces, job.direction, stream)
            end.record(stream)
        except Exception as e:  # reported as a failed job, never raised into the engine
            log.warning("copy job %d (%s) failed: %s", job.job_id, job.direction.value, e)
            self._failed.append(CopyResult(job.job_id, job.direction, False, 0, 0.0, repr(e)))
            return
        self._inflight[lane].append(_InFlight(job, start, end, pieces.total, job.slots))

    def _copy(self, pieces: Pieces, direction: Direction, stream: Any) -> None:
        if not pieces.segments:
            return
        handle = stream.cuda_stream
        if self.batched:
            src, dst, sizes = pieces.flat()
            to_device = direction is Direction.LOAD
            self._driver.memcpy_batch(
                dst, src, sizes, to_device, self.device.index or 0, to_device, handle
            )
            return
        memcpy = self._driver.memcpy
        for src_arr, dst_arr, nbytes in pieces.segments:
            for s, d in zip(src_arr.tolist(), dst_arr.tolist(), strict=True):
                memcpy(d, s, nbytes, handle)

    def get_finished(self) -> list[CopyResult]:
        results, self._failed = self._failed, []
        for queue in self._inflight.values():
            while queue and queue[0].end.query():
                done = queue.popleft()
                seconds = done.start.elapsed_time(done.end) / 1e3
                results.append(
                    CopyResult(done.job.job_id, done.job.direction, True, done.nbytes, seconds)
                )
                self._events += (done.start, done.end)
        for result in results:
            self._reported(result.job_id)
        return results

    def wait(self, job_ids: Iterable[int]) -> None:
        wanted = set(job_ids)
        for queue in self._inflight.values():
            for item in queue:
                if item.job.job_id in wanted:
                    item.end.synchronize()

    def shutdown(self) -> None:
        for stream in self._streams.values():
            stream.synchronize()

    def _batch_self_check(self) -> bool:
        """Copy a few pieces both ways with the batch call and compare; False (and per-piece
        copies from then on) on any mismatch or error."""
        torch = self._torch
        try:
            n = 4096
            device = torch.arange(4 * n, dtype=torch.int32, device=self.device).view(torch.uint8)
            host = torch.zeros(4 * n * 4, dtype=torch.uint8).pin_memory()
            stream = torch.cuda.Stream(self.device)
            src = np.array([device.data_ptr() + i * n for i in (3, 0, 2)], dtype=np.int64)
            dst = np.array([host.data_ptr() + i * n for i in (0, 1, 2)], dtype=np.int64)
            sizes = np.full(3, n, dtype=np.int64)
            torch.cuda.synchronize(self.device)
            self._driver.memcpy_batch(
                dst, src, sizes, False, self.device.index or 0, False, stream.cuda_stream
            )
            stream.synchronize()
            flat = device.cpu()
            expected = torch.cat([flat[3 * n : 4 * n], flat[0:n], flat[2 * n : 3 * n]])
            ok = bool(torch.equal(host[: 3 * n], expected))
            back = torch.zeros_like(device)
            self._driver.memcpy_batch(
                np.array([back.data_ptr() + n], dtype=np.int64),
                np.array([host.data_ptr()], dtype=np.int64),
                np.array([n], dtype=np.int64),
                True,
                self.device.index or 0,
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
