"""The few CUDA driver calls kvtier makes, through ctypes on libcuda: copies (batched and per
piece) and host registration. Importing this module needs neither CUDA nor torch.

Driver calls, not the runtime's: a failed driver call leaves no "last error" behind in the CUDA
runtime, whereas a failed `cudaHostRegister` through torch's binding leaves one pending on the
thread, and torch's next kernel launch raises it against an unrelated op (vLLM PR #51081). A
second ctypes `libcudart` to drain it could be another instance of the runtime than torch's
(a wheel may carry its own `libcudart-<hash>.so`), and would drain nothing.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from tiers.copy.mapping import IntArray

__all__ = ["CudaDriver", "CudaError", "MemcpyAttributes", "MemLocation"]

# CUmemcpySrcAccessOrder and CUmemLocationType (cuda.h, CUDA >= 12.8).
ORDER_STREAM, ORDER_ANY = 1, 3
LOC_DEVICE, LOC_HOST = 1, 2
# cuMemHostRegister flags: PORTABLE keeps what cudaHostRegisterDefault gives under unified
# addressing (the pages count as pinned in every context, not just the current one).
HOST_REGISTER_PORTABLE = 0x01


class CudaError(OSError):
    """A driver call returned a CUresult other than CUDA_SUCCESS (any thread: a value)."""

    def __init__(self, call: str, code: int) -> None:
        super().__init__(f"{call} failed with CUresult {code}")
        self.call = call
        self.code = code


class MemLocation(ctypes.Structure):
    """`CUmemLocation` of the driver API (worker process: passed to the driver)."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """`CUmemcpyAttributes` of the driver API (worker process: passed to the driver)."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", MemLocation),
        ("dstLocHint", MemLocation),
        ("flags", ctypes.c_uint),
    ]


class CudaDriver:
    """libcuda's copy and registration entry points (worker process; the engine's thread for
    copies, the worker's thread for registration).

    `lib`: the loaded library, or anything with the same attributes (tests hand in ctypes
    callbacks with the driver's signatures, so the marshalling below runs in CI); None loads
    `libcuda.so.1`.

    ctypes rather than `cuda.bindings`: the pointer arrays go to the driver as the numpy buffers
    they already are (no per-element conversion), the API did not change shape between
    cuda-python releases, and there is no extra package to install.
    """

    def __init__(self, lib: Any = None) -> None:
        if lib is None:  # pragma: no cover - needs a machine with the NVIDIA driver
            lib = ctypes.CDLL("libcuda.so.1")
        self._memcpy_async = _bind(
            lib.cuMemcpyAsync,
            [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p],
        )
        self._register = _bind(
            lib.cuMemHostRegister_v2, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        )
        self._unregister = _bind(lib.cuMemHostUnregister, [ctypes.c_void_p])
        # CUDA 13 renamed the batch entry point (`_v2`, no failIdx); 12.8 and 12.9 have failIdx.
        self._batch: Any = None
        self.batch_symbol: str | None = None
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
                ctypes.POINTER(MemcpyAttributes),
                ctypes.c_void_p,
                ctypes.c_size_t,
            ]
            self._batch = _bind(
                fn,
                [*args, ctypes.c_void_p, ctypes.c_void_p] if fail_idx else [*args, ctypes.c_void_p],
            )
            self.batch_symbol, self._batch_has_fail_idx = symbol, fail_idx
            break

    @property
    def has_batch(self) -> bool:
        return self._batch is not None

    def memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        err = self._memcpy_async(dst, src, nbytes, stream)
        if err:
            raise CudaError("cuMemcpyAsync", err)

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
        """One `cuMemcpyBatchAsync` for every piece. `src_any`: the driver may read the sources
        at any time from this call on (CU_MEMCPY_SRC_ACCESS_ORDER_ANY), which is only right
        when no earlier work on the stream, waited-for events included, writes them; else they
        are read in stream order."""
        count = len(dst)
        host, dev = MemLocation(LOC_HOST, 0), MemLocation(LOC_DEVICE, device)
        attrs = MemcpyAttributes(
            ORDER_ANY if src_any else ORDER_STREAM,
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
            raise CudaError(self.batch_symbol or "cuMemcpyBatchAsync", err)

    def host_register(self, address: int, nbytes: int) -> int:
        """Page-lock `[address, address + nbytes)` for DMA (portable); the CUresult (0: done)."""
        return int(self._register(address, nbytes, HOST_REGISTER_PORTABLE))

    def host_unregister(self, address: int) -> int:
        """Undo the `host_register` that started at `address`; the CUresult."""
        return int(self._unregister(address))


def _bind(fn: Any, argtypes: list[Any]) -> Any:
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn
