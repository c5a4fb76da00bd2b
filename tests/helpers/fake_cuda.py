"""A fake of what the CUDA copy engine uses (`tiers.copy.cuda_api.CudaApi`), for machines
without a GPU: it grants what CUDA guarantees and nothing more, and moves real bytes.

- Memory: "device" tensors are CPU tensors, so addresses are real and every copy is a memmove
  between them; host memory counts as pinned once registered (`pin`, `host_buffer`, the
  driver's `cuMemHostRegister_v2`).
- Streams: each is a FIFO of operations run late, on a thread of its own.
- Events: `record` queues a mark on the stream; the event completes only when the stream
  reaches it. `wait_event` captures the most recent record at the call, as CUDA does.
- libcuda (`FakeLibcuda`): `cuMemcpyAsync`, `cuMemcpyBatchAsync(_v2)`, `cuMemHostRegister_v2`,
  `cuMemHostUnregister` as ctypes callbacks with the driver's signatures, so `CudaDriver`'s
  marshalling runs. A batch source read in stream order (STREAM) is read when the stream
  reaches the copy; an ANY source may be read at any time from the call on, and the fake reads
  it at the call (`any_reads="call"`, the earliest CUDA allows) or in stream order ("stream").
  The legacy NULL stream, a piece whose host range is part registered and part not, and an
  overlapping registration (712) or one above `register_cap` (2) are refused.
- The runtime's last error: a failed `runtime_host_register` (torch's `cudaHostRegister`) sets
  a per-thread error that the thread's next kernel launch (`launch`, `to_device`) raises.
- Injected errors: `fail={"cuMemcpyAsync": 3}` makes the 3rd call of that entry point return
  CUDA_ERROR_UNKNOWN (a tuple: each of those calls; "launch": kernel launches raise);
  `fail_op=n` makes the n-th copy a stream runs an asynchronous, sticky error (every later
  query, synchronize and elapsed_time raises, as after a lost context).
"""

from __future__ import annotations

import bisect
import ctypes
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from tiers.copy.cuda_driver import (
    LOC_HOST,
    ORDER_ANY,
    ORDER_STREAM,
    CudaDriver,
    MemcpyAttributes,
)

SUCCESS, INVALID_VALUE, OUT_OF_MEMORY, UNKNOWN = 0, 1, 2, 999
ALREADY_REGISTERED, NOT_REGISTERED = 712, 713
STICKY = "CUDA error: an illegal memory access was encountered"


class FakeStream:
    """A CUDA stream: a FIFO of operations run in order on its own thread, late."""

    def __init__(self, cuda: FakeCuda, handle: int) -> None:
        self._cuda = cuda
        self.cuda_stream = handle
        self._queue: deque[Callable[[], None]] = deque()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"fake-stream-{handle}", daemon=True)
        self._thread.start()

    def enqueue(self, op: Callable[[], None]) -> None:
        with self._cond:
            self._queue.append(op)
            self._cond.notify_all()

    def wait_event(self, event: FakeEvent) -> None:
        generation = event.recorded  # the record as of this call, not a later one
        self.enqueue(lambda: event.wait_for(generation))

    def synchronize(self) -> None:
        done = threading.Event()
        self.enqueue(done.set)
        assert done.wait(30), f"fake stream {self.cuda_stream} never drained"
        self._cuda.raise_sticky()

    def close(self) -> None:
        with self._cond:
            self._queue.append(_STOP)
            self._cond.notify_all()
        self._thread.join(5)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                op = self._queue.popleft()
            if op is _STOP:
                return
            if self._cuda.lateness:
                time.sleep(self._cuda.lateness)
            op()


def _STOP() -> None:  # the stream's end (never run)
    raise AssertionError


class FakeEvent:
    """A CUDA event: complete once its stream reaches its most recent record."""

    def __init__(self, cuda: FakeCuda, timing: bool) -> None:
        self._cuda = cuda
        self.timing = timing
        self.recorded = 0
        self._reached = 0
        self._at = 0.0

    def record(self, stream: FakeStream) -> None:
        self.recorded += 1
        generation = self.recorded
        stream.enqueue(lambda: self._reach(generation))

    def _reach(self, generation: int) -> None:
        with self._cuda.cond:
            self._reached = max(self._reached, generation)
            self._at = time.perf_counter()
            self._cuda.cond.notify_all()

    def wait_for(self, generation: int) -> None:
        with self._cuda.cond:
            assert self._cuda.cond.wait_for(lambda: self._reached >= generation, 30)

    def query(self) -> bool:
        self._cuda.raise_sticky()
        return self._reached >= self.recorded

    def synchronize(self) -> None:
        self.wait_for(self.recorded)
        self._cuda.raise_sticky()

    def elapsed_time(self, end: FakeEvent) -> float:
        self._cuda.raise_sticky()
        assert self.timing and end.timing, "elapsed_time needs timing events"
        assert self.query() and end.query(), "elapsed_time of an incomplete event"
        return (end._at - self._at) * 1e3


class FakeLibcuda:
    """libcuda's entry points as ctypes callbacks (what `CudaDriver(lib=...)` binds).
    `batch`: "v2" (CUDA 13), "v1" (12.8: with failIdx) or None (an older driver)."""

    def __init__(self, cuda: FakeCuda, batch: str | None) -> None:
        self._cuda = cuda
        c = ctypes
        self.cuMemcpyAsync = c.CFUNCTYPE(c.c_int, c.c_uint64, c.c_uint64, c.c_size_t, c.c_void_p)(
            self._guard("cuMemcpyAsync", self._memcpy)
        )
        self.cuMemHostRegister_v2 = c.CFUNCTYPE(c.c_int, c.c_void_p, c.c_size_t, c.c_uint)(
            self._guard("cuMemHostRegister_v2", self._register)
        )
        self.cuMemHostUnregister = c.CFUNCTYPE(c.c_int, c.c_void_p)(
            self._guard("cuMemHostUnregister", self._unregister)
        )
        head = [c.c_void_p, c.c_void_p, c.c_void_p, c.c_size_t, c.POINTER(MemcpyAttributes)]
        head += [c.c_void_p, c.c_size_t]
        if batch == "v2":
            self.cuMemcpyBatchAsync_v2 = c.CFUNCTYPE(c.c_int, *head, c.c_void_p)(
                self._guard("cuMemcpyBatchAsync_v2", self._batch)
            )
        elif batch == "v1":
            self.cuMemcpyBatchAsync = c.CFUNCTYPE(c.c_int, *head, c.c_void_p, c.c_void_p)(
                self._guard("cuMemcpyBatchAsync", self._batch_v1)
            )

    def _guard(self, name: str, fn: Callable[..., int]) -> Callable[..., int]:
        def call(*args: Any) -> int:
            try:
                if self._cuda.injected(name):
                    return UNKNOWN
                return fn(*args)
            except BaseException as e:  # an exception cannot cross the C boundary: keep it
                self._cuda.callback_errors.append(e)
                return UNKNOWN

        return call

    def _memcpy(self, dst: int, src: int, nbytes: int, stream: int | None) -> int:
        target = self._cuda.stream_of(stream)
        if target is None:
            return INVALID_VALUE
        target.enqueue(lambda: self._cuda.move(dst, src, nbytes))
        return SUCCESS

    def _batch_v1(self, *args: Any) -> int:
        *head, fail_idx, stream = args
        if fail_idx is None:
            return INVALID_VALUE
        return self._batch(*head, stream)

    def _batch(
        self,
        dsts: int | None,
        srcs: int | None,
        sizes: int | None,
        count: int,
        attrs: Any,
        attr_idxs: int | None,
        num_attrs: int,
        stream: int | None,
    ) -> int:
        target = self._cuda.stream_of(stream)
        if target is None or count == 0 or not 1 <= num_attrs <= count:
            return INVALID_VALUE
        if dsts is None or srcs is None or sizes is None or attr_idxs is None:
            return INVALID_VALUE
        dst = list((ctypes.c_uint64 * count).from_address(dsts))
        src = list((ctypes.c_uint64 * count).from_address(srcs))
        size = list((ctypes.c_uint64 * count).from_address(sizes))
        idxs = list((ctypes.c_uint64 * num_attrs).from_address(attr_idxs))
        if idxs[0] != 0 or idxs != sorted(set(idxs)) or idxs[-1] >= count:
            return INVALID_VALUE
        orders, host_dst = [], []
        for i in range(count):
            attr = attrs[bisect.bisect_right(idxs, i) - 1]
            if attr.srcAccessOrder not in (ORDER_STREAM, ORDER_ANY):
                return INVALID_VALUE
            host_side = dst[i] if attr.dstLocHint.type == LOC_HOST else src[i]
            if self._cuda.registration(host_side, size[i]) == "part":
                return INVALID_VALUE
            orders.append(attr.srcAccessOrder)
            host_dst.append(attr.dstLocHint.type == LOC_HOST)
        self._cuda.batches.append(orders)
        sources: list[int | ctypes.Array[ctypes.c_char]] = list(src)
        for i in range(count):
            if orders[i] == ORDER_ANY and self._cuda.any_reads == "call":
                sources[i] = (ctypes.c_char * size[i]).from_buffer_copy(
                    ctypes.string_at(src[i], size[i])
                )

        def run() -> None:
            for i in range(count):
                self._cuda.move(dst[i], sources[i], size[i])

        target.enqueue(run)
        return SUCCESS

    def _register(self, address: int | None, nbytes: int, flags: int) -> int:
        return self._cuda.register(address or 0, nbytes)

    def _unregister(self, address: int | None) -> int:
        return self._cuda.unregister(address or 0)


class FakeCuda:
    """The fake `CudaApi`; `close` stops its streams' threads."""

    def __init__(
        self,
        *,
        batch: str | None = "v2",
        any_reads: str = "call",
        fail: dict[str, int | tuple[int, ...]] | None = None,
        fail_op: int | None = None,
        register_cap: int = 1 << 62,
        stream_pool: int | None = None,
        lateness: float = 0.0,
    ) -> None:
        self.cond = threading.Condition()
        self.any_reads = any_reads
        self.lateness = lateness
        self.register_cap = register_cap
        self._fail = dict(fail or {})
        self._calls: dict[str, int] = {}
        self._fail_op = fail_op
        self._ops = 0
        self._sticky: str | None = None
        self._ranges: dict[int, int] = {}  # registered host ranges: start -> end
        self._starts: list[int] = []
        self._last_error = threading.local()
        self._kept: list[torch.Tensor] = []
        self._streams: dict[int, FakeStream] = {}
        self._pool = stream_pool
        self._drawn = 0
        self.callback_errors: list[BaseException] = []
        self.batches: list[list[int]] = []
        """Per batch call, each piece's source access order (ORDER_STREAM or ORDER_ANY)."""
        self.device_index = 0
        self.lib = FakeLibcuda(self, batch)
        self.driver = CudaDriver(lib=self.lib)
        self.compute = self._new_stream()

    # -- the CudaApi --------------------------------------------------------------------------

    def is_device(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether each row of a (rows, bytes) tensor lies in one registration."""
        rows = tensor.view(tensor.shape[0], -1) if tensor.dim() > 1 else tensor.view(1, -1)
        step = rows.stride(0) * rows.element_size()
        nbytes = rows.shape[1] * rows.element_size()
        return all(
            self.registration(rows.data_ptr() + r * step, nbytes) == "all"
            for r in range(rows.shape[0])
        )

    def stream(self) -> FakeStream:
        if self._pool is not None and len(self._streams) > self._pool:
            self._drawn += 1
            return list(self._streams.values())[self._drawn % len(self._streams)]
        return self._new_stream()

    def event(self, timing: bool) -> FakeEvent:
        return FakeEvent(self, timing)

    def current_stream(self) -> FakeStream:
        return self.compute

    def synchronize(self) -> None:
        for stream in list(self._streams.values()):
            stream.synchronize()

    def synchronize_quietly(self) -> None:
        """Drain every stream without raising a sticky error (what a test waits with)."""
        for stream in list(self._streams.values()):
            done = threading.Event()
            stream.enqueue(done.set)
            assert done.wait(30)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        self.launch_check()
        return host.clone()

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        buffer = torch.zeros(nbytes, dtype=torch.uint8)
        self.pin(buffer)
        return buffer

    # -- for tests ----------------------------------------------------------------------------

    def pin(self, tensor: torch.Tensor) -> None:
        """Page-lock a tensor's memory, as `pin_memory` would; the fake keeps the tensor (so
        its addresses are not reused while they count as registered)."""
        start = tensor.data_ptr()
        assert self.register(start, tensor.untyped_storage().nbytes()) == SUCCESS
        self._kept.append(tensor)

    def launch(self, stream: FakeStream, op: Callable[[], None]) -> None:
        """A kernel launch: raises the thread's pending error (clearing it), else queues `op`."""
        self.launch_check()
        stream.enqueue(op)

    def launch_check(self) -> None:
        if self.injected("launch"):
            raise RuntimeError("CUDA error: unknown error")
        code = getattr(self._last_error, "code", 0)
        if code:
            self._last_error.code = 0
            raise RuntimeError(f"CUDA error: {code} (raised by a later kernel launch)")

    def runtime_host_register(self, address: int, nbytes: int) -> int:
        """torch's `cudart().cudaHostRegister`: a failure leaves the thread's last error set."""
        code = self.register(address, nbytes)
        if code:
            self._last_error.code = code
        return code

    def close(self) -> None:
        for stream in list(self._streams.values()):
            stream.close()

    # -- the fake's insides -------------------------------------------------------------------

    def _new_stream(self) -> FakeStream:
        handle = 0x1000 + len(self._streams)
        stream = self._streams[handle] = FakeStream(self, handle)
        return stream

    def stream_of(self, handle: int | None) -> FakeStream | None:
        return None if handle is None else self._streams.get(handle)

    def injected(self, name: str) -> bool:
        calls = self._calls[name] = self._calls.get(name, 0) + 1
        when = self._fail.get(name, ())
        return calls in (when if isinstance(when, tuple) else (when,))

    def raise_sticky(self) -> None:
        if self._sticky is not None:
            raise RuntimeError(self._sticky)

    def move(self, dst: int, src: int | ctypes.Array[ctypes.c_char], nbytes: int) -> None:
        with self.cond:
            self._ops += 1
            if self._ops == self._fail_op:
                self._sticky = STICKY
            if self._sticky is not None:
                return
        ctypes.memmove(dst, src, nbytes)

    def registration(self, start: int, nbytes: int) -> str:
        """Whether [start, start + nbytes) is registered: "all", "none" or "part"."""
        end = start + nbytes
        i = bisect.bisect_right(self._starts, start) - 1
        if i >= 0 and self._ranges[self._starts[i]] > start:
            return "all" if self._ranges[self._starts[i]] >= end else "part"
        j = i + 1
        if j < len(self._starts) and self._starts[j] < end:
            return "part"
        return "none"

    def register(self, start: int, nbytes: int) -> int:
        if nbytes > self.register_cap:
            return OUT_OF_MEMORY
        if nbytes == 0 or self.registration(start, nbytes) != "none":
            return ALREADY_REGISTERED if nbytes else INVALID_VALUE
        bisect.insort(self._starts, start)
        self._ranges[start] = start + nbytes
        return SUCCESS

    def unregister(self, start: int) -> int:
        if start not in self._ranges:
            return NOT_REGISTERED
        del self._ranges[start]
        self._starts.remove(start)
        return SUCCESS
