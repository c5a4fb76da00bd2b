"""The primary region: one shared-memory file holding every slot of the CPU primary tier, and
each process's mapping of it (`PrimaryRegion`).

The scheduler process creates it and maps it as bytes (numpy or memoryview), so secondary tiers
read and write slots in place; each worker maps it and takes its own shard of every slot as a
tensor, which its copy engine fills and drains. No KV byte crosses a pipe.

The file's layout, header and name are in `tiers.region.file`; mapping its pages ahead of the
first copies in `tiers.region.prefault`. The header records a random token, which every process
that maps the region reads (`PrimaryRegion.token`): two processes of one engine prove with it
that they map the same file (`connectors.roles`). The file is created sparse (ftruncate; no
page is touched until a copy writes it), removed by its creator at close, and a file left by a
process that died is removed at the next `create` in the same directory.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tiering.errors import RegionError
from tiers.region.file import (
    DEFAULT_DIRECTORY,
    PAGE,
    TOKEN_BYTES,
    RegionLayout,
    cleanup_stale,
    creator_pid,
    hold,
    human_size,
    read_header,
    region_path,
    write_header,
)
from tiers.region.prefault import Prefault

if TYPE_CHECKING:
    import torch

    from tiers.copy.cuda_driver import CudaDriver

__all__ = [
    "DEFAULT_DIRECTORY",
    "PAGE",
    "TOKEN_BYTES",
    "PrimaryRegion",
    "RegionLayout",
    "cleanup_stale",
    "region_path",
]

log = logging.getLogger("tiers.region")  # every line about the region under one logger

MAX_REGISTRATION = 64 << 30
"""The most bytes `PrimaryRegion.pin` registers in one call (vLLM's bound, V32 `gpu_worker.py`)."""


class PrimaryRegion:
    """One process's mapping of the primary region: any process (the scheduler creates it,
    each worker attaches), any thread; the creator owns the file.

    Use `create` in the scheduler process (once per engine) and `attach` in each worker.
    `close` unmaps (once no view is alive) and, in the creator, removes the file.
    """

    def __init__(
        self, path: Path, layout: RegionLayout, fd: int, owner: bool, token: bytes
    ) -> None:
        self.path = path
        self.layout = layout
        self.owner = owner
        self.token = token
        """The random token its creator wrote in the header: the same in every process that
        maps this file, and in no other region."""
        self._fd = fd
        self._mmap: mmap.mmap | None = mmap.mmap(fd, layout.file_size, mmap.MAP_SHARED)
        self._pinned: list[int] = []  # where each registration starts
        self._driver: CudaDriver | None = None
        self._prefault = Prefault()

    # -- lifecycle ------------------------------------------------------------------------------

    @classmethod
    def create(
        cls, name: str, layout: RegionLayout, directory: str | Path = DEFAULT_DIRECTORY
    ) -> PrimaryRegion:
        """Create the region file for engine `name` (sparse) and map it.

        Removes regions left in `directory` by dead processes first. Fails with `RegionError`
        when another live process holds a region of that name, or when the directory has less
        free space than the region needs (the message gives both sizes).
        """
        directory = Path(directory)
        path = region_path(name, directory)
        cleanup_stale(directory)
        size = layout.file_size
        try:
            stats = os.statvfs(directory)
        except OSError as e:
            raise RegionError(f"primary region: cannot use directory {directory}: {e}") from e
        available = stats.f_bavail * stats.f_frsize
        if size > available:
            raise RegionError(
                f"primary region {path}: needs {human_size(size)} ({size} bytes) but {directory} "
                f"has {human_size(available)} ({available} bytes) available; lower "
                "primary.capacity or give the directory more space (e.g. a larger /dev/shm)"
            )
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pid = creator_pid(path)
            raise _RegionExists(
                f"primary region {path} already exists and belongs to live process {pid}: "
                "two engines share one engine id"
            ) from None
        except OSError as e:
            raise RegionError(f"primary region {path}: cannot create: {e.strerror}") from e
        hold(fd)  # before the header: a ready region nobody holds is dead
        token = os.urandom(TOKEN_BYTES)
        try:
            os.ftruncate(fd, size)
            write_header(fd, layout, token)  # ready: joiners may map now
            region = cls(path, layout, fd, owner=True, token=token)
        except OSError as e:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise RegionError(
                f"primary region {path}: cannot allocate {human_size(size)} ({size} bytes): "
                f"{e.strerror or e}"
            ) from e
        log.info(
            "primary region %s: %d slots of %d bytes", path, layout.num_slots, layout.slot_stride
        )
        return region

    @classmethod
    def open(
        cls,
        name: str,
        layout: RegionLayout,
        directory: str | Path = DEFAULT_DIRECTORY,
        timeout: float = 30.0,
    ) -> PrimaryRegion:
        """Create the region, or join it when another process of the same engine created it
        first (vLLM builds its workers before its scheduler; either may come first). Joining
        checks the layout; the creator removes the file at its close."""
        try:
            return cls.create(name, layout, directory)
        except _RegionExists:
            return cls.attach(name, layout, directory, timeout)

    @classmethod
    def attach(
        cls,
        name: str,
        layout: RegionLayout | None = None,
        directory: str | Path = DEFAULT_DIRECTORY,
        timeout: float = 30.0,
    ) -> PrimaryRegion:
        """Map an existing region (a worker, or any other process), waiting up to `timeout`
        seconds for its creator. With `layout`, a region of another layout is an error."""
        path = region_path(name, Path(directory))
        deadline = time.monotonic() + timeout
        while True:
            found = read_header(path)
            if found is not None and found[0]:
                break
            if time.monotonic() >= deadline:
                raise RegionError(f"primary region {path}: not created within {timeout:g}s")
            time.sleep(0.01)
        _, stored, token = found
        if layout is not None and stored != layout:
            raise RegionError(f"primary region {path}: has layout {stored}, expected {layout}")
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise RegionError(f"primary region {path}: cannot open: {e.strerror}") from e
        hold(fd)
        return cls(path, stored, fd, owner=False, token=token)

    def close(self) -> None:
        """Unregister, unmap and, in the creator, remove the file. Safe to call twice.

        If a view of the mapping is still alive, the unmapping is left to the garbage collector
        (closing would invalidate memory a tensor still points at); the file goes regardless.
        """
        self.unpin()
        self._prefault.stop()  # within one chunk: never unmap under it
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                log.debug("primary region %s: views still alive; unmapped when they go", self.path)
            self._mmap = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self.owner:
            self.path.unlink(missing_ok=True)
            self.owner = False

    def __enter__(self) -> PrimaryRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- views ----------------------------------------------------------------------------------

    def _buffer(self) -> mmap.mmap:
        if self._mmap is None:
            raise RegionError(f"primary region {self.path} is closed")
        return self._mmap

    def slots(self) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """Every slot as a `(num_slots, slot_stride)` uint8 array over the shared pages."""
        layout = self.layout
        flat = np.frombuffer(
            self._buffer(),
            dtype=np.uint8,
            count=layout.num_slots * layout.slot_stride,
            offset=PAGE,
        )
        return flat.reshape(layout.num_slots, layout.slot_stride)

    def memoryview(self) -> memoryview:
        """The slots as one flat byte memoryview: slot s is `[s*slot_stride, (s+1)*slot_stride)`."""
        layout = self.layout
        return memoryview(self._buffer())[PAGE : PAGE + layout.num_slots * layout.slot_stride]

    def shard(self, rank: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """Worker `rank`'s shard of every slot, `(num_slots, shard_bytes)`, strided in place."""
        if not 0 <= rank < self.layout.num_workers:
            raise RegionError(f"rank {rank} is outside 0..{self.layout.num_workers - 1}")
        start = rank * self.layout.shard_bytes
        return self.slots()[:, start : start + self.layout.shard_bytes]

    def shard_tensor(self, rank: int) -> torch.Tensor:
        """Worker `rank`'s shard as a uint8 torch tensor over the shared pages (no copy)."""
        import torch

        return torch.from_numpy(self.shard(rank))

    @property
    def address(self) -> int:
        """Address of slot 0 in this process."""
        return int(self.slots().ctypes.data)

    # -- prefault ------------------------------------------------------------------------------

    def prefault(self, rank: int | None = None, sync: int = 0) -> bool:
        """Map the slots' pages writable in this process, slot 0 first (the order in which a
        fresh pool hands slots out): the slots of the region's first `sync` bytes before
        returning, the others on a background thread that maps while the process's other
        threads are idle (`tiers.region.prefault`); with `rank`, only that worker's shard of
        each slot. A first write to a fresh page of shared memory costs the kernel an
        allocation, zeroing and a page-table entry per page (what that costs the first copies,
        and what a prefault running beside them costs the first requests: BENCHMARKS.md).
        Nothing is written; the pages count as used from then on.

        Returns False (nothing started) where the kernel lacks MADV_POPULATE_WRITE (before
        Linux 5.14) or the region is closed; the copies are then as before, slower at first."""
        if self._prefault.started or self._mmap is None:
            return self._prefault.started
        sync_slots = -(-sync // self.layout.slot_stride)
        return self._prefault.start(self.address, self.layout, rank, self.path, sync_slots)

    def prefault_done(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` seconds for the prefault; whether it has ended (or none runs)."""
        return self._prefault.done(timeout)

    # -- CUDA -----------------------------------------------------------------------------------

    def pin(
        self,
        rank: int | None = None,
        *,
        driver: CudaDriver | None = None,
        chunk_bytes: int = MAX_REGISTRATION,
    ) -> bool:
        """Register the slots with the CUDA driver (page-locked, for async DMA), through the
        driver API (`cuMemHostRegister_v2`): a failure leaves no error pending in the CUDA
        runtime, where torch's next launch would raise it against an unrelated op. Idempotent.

        - With `rank`, only that worker's shard of each slot, where the shards are whole pages
          (else every slot: registration locks whole pages, and a copy must not straddle a
          registered and an unregistered page).
        - In chunks of at most `chunk_bytes` that end on slot boundaries, so no copy straddles
          two registrations (`cuMemcpyBatchAsync` refuses a range part registered and part
          not) and no single registration reaches the driver's ceiling (vLLM measured one
          registration of 512 GiB failing with free memory to spare).
        - A failed chunk unregisters the chunks before it.

        Returns False, logged, and the copies stay pageable (slower, still correct), when CUDA
        is not available or registration fails. `driver`: None is libcuda's.
        """
        if self._pinned:
            return True
        if driver is None:
            try:
                import torch

                if not torch.cuda.is_available():
                    return False
                torch.cuda.synchronize()  # a current context on this thread: driver calls need one
                from tiers.copy.cuda_driver import CudaDriver

                driver = CudaDriver()
            except Exception as e:  # a driver problem must not stop the engine
                log.warning("primary region %s: cannot pin: %s", self.path, e)
                return False
        done: list[int] = []
        for start, size in self._pin_ranges(rank, chunk_bytes):
            err = driver.host_register(start, size)
            if err:
                for address in reversed(done):
                    driver.host_unregister(address)
                log.warning(
                    "primary region %s: cuMemHostRegister of %s at offset %d failed (CUresult "
                    "%d); copies stay pageable (slower)",
                    self.path,
                    human_size(size),
                    start - self.address,
                    err,
                )
                return False
            done.append(start)
        self._pinned, self._driver = done, driver
        return True

    def _pin_ranges(self, rank: int | None, chunk_bytes: int) -> list[tuple[int, int]]:
        """(address, bytes) of each registration `pin` makes."""
        layout, base = self.layout, self.address
        stride = layout.slot_stride
        if rank is not None and layout.num_workers > 1 and layout.shard_bytes % PAGE == 0:
            offset = base + rank * layout.shard_bytes
            return [(offset + s * stride, layout.shard_bytes) for s in range(layout.num_slots)]
        per = max(1, chunk_bytes // stride)
        return [
            (base + s * stride, min(per, layout.num_slots - s) * stride)
            for s in range(0, layout.num_slots, per)
        ]

    def unpin(self) -> None:
        if self._driver is None:
            return
        for address in self._pinned:
            err = self._driver.host_unregister(address)
            if err:
                log.warning("primary region %s: cuMemHostUnregister failed (%d)", self.path, err)
        self._pinned, self._driver = [], None

    @property
    def pinned(self) -> bool:
        return bool(self._pinned)


class _RegionExists(RegionError):
    """A live process holds a region of that name (internal: `open` joins it)."""
