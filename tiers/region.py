"""The primary region: one shared-memory file holding every slot of the CPU primary tier.

The scheduler process creates it and maps it as bytes (numpy or memoryview), so secondary tiers
read and write slots in place; each worker maps it and takes its own shard of every slot as a
tensor, which its copy engine fills and drains. No KV byte crosses a pipe.

File layout (`<directory>/kvtier-<name>.region`, by default in /dev/shm):

    [ header: one page ][ slot 0 ][ slot 1 ] ... [ slot N-1 ]
    slot s  = [ worker 0 shard | worker 1 shard | ... | worker W-1 shard | pad to a page ]
    a shard = per KV tensor of that worker, in order: page_bytes x blocks_per_chunk bytes

The header records the layout, the creator's pid and a random token, which every process that
maps the region reads (`PrimaryRegion.token`): two processes of one engine prove with it that
they map the same file (`connectors.roles`). The file is created sparse (ftruncate; no
page is touched until a copy writes it), removed by its creator at close, and a file left by a
process that died is removed at the next `create` in the same directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import re
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tiering.errors import RegionError

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_DIRECTORY",
    "PAGE",
    "TOKEN_BYTES",
    "PrimaryRegion",
    "RegionLayout",
    "cleanup_stale",
]

log = logging.getLogger(__name__)

DEFAULT_DIRECTORY = Path("/dev/shm")
PAGE = mmap.PAGESIZE
_MAGIC = b"KVTIERRG"
_VERSION = 2
# magic, version, ready, creator pid, num_slots, shard_bytes, num_workers, slot_stride, token
_HEADER = struct.Struct("<8sIIQQQQQ16s")
TOKEN_BYTES = 16
_READY_OFFSET = 12
_MADV_POPULATE_WRITE = 23  # Linux 5.14 and later
_PREFAULT_CHUNK = 16 << 20
"""Bytes mapped per call: a stopping prefault ends within one chunk (a few ms)."""
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z")
_PREFIX, _SUFFIX = "kvtier-", ".region"


@dataclass(frozen=True, slots=True)
class RegionLayout:
    """How many slots, and how a slot is split among workers (any process: a value)."""

    num_slots: int
    shard_bytes: int
    """One worker's part of one block: all its KV tensors x blocks per chunk."""
    num_workers: int = 1

    def __post_init__(self) -> None:
        for name in ("num_slots", "shard_bytes", "num_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise RegionError(
                    f"region layout: {name} must be a positive integer, got {value!r}"
                )

    @property
    def slot_stride(self) -> int:
        """Bytes from one slot to the next: every worker's shard, rounded up to a page."""
        raw = self.shard_bytes * self.num_workers
        return -(-raw // PAGE) * PAGE

    @property
    def file_size(self) -> int:
        return PAGE + self.num_slots * self.slot_stride


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
        self._pinned_ptr: int | None = None
        self._prefault: threading.Thread | None = None
        self._stop_prefault = threading.Event()

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
                f"primary region {path}: needs {_human(size)} ({size} bytes) but {directory} has "
                f"{_human(available)} ({available} bytes) available; lower primary.capacity or "
                "give the directory more space (e.g. a larger /dev/shm)"
            )
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pid = _creator_pid(path)
            raise _RegionExists(
                f"primary region {path} already exists and belongs to live process {pid}: "
                "two engines share one engine id"
            ) from None
        except OSError as e:
            raise RegionError(f"primary region {path}: cannot create: {e.strerror}") from e
        token = os.urandom(TOKEN_BYTES)
        try:
            os.ftruncate(fd, size)
            header = _HEADER.pack(
                _MAGIC,
                _VERSION,
                0,
                os.getpid(),
                layout.num_slots,
                layout.shard_bytes,
                layout.num_workers,
                layout.slot_stride,
                token,
            )
            os.pwrite(fd, header, 0)
            os.pwrite(fd, struct.pack("<I", 1), _READY_OFFSET)  # ready: joiners may map now
            region = cls(path, layout, fd, owner=True, token=token)
        except OSError as e:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise RegionError(
                f"primary region {path}: cannot allocate {_human(size)} ({size} bytes): "
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
            found = _read_header(path)
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
        return cls(path, stored, fd, owner=False, token=token)

    def close(self) -> None:
        """Unregister, unmap and, in the creator, remove the file. Safe to call twice.

        If a view of the mapping is still alive, the unmapping is left to the garbage collector
        (closing would invalidate memory a tensor still points at); the file goes regardless.
        """
        self.unpin()
        self._stop_prefault.set()
        if self._prefault is not None:
            self._prefault.join()  # within one chunk: never unmap under it
            self._prefault = None
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

    def prefault(self, rank: int | None = None) -> bool:
        """Map the slots' pages writable in this process, on a background thread, slot 0
        first (the order in which a fresh pool hands slots out); with `rank`, only that
        worker's shard of each slot. A first write to a fresh page of shared memory costs the
        kernel an allocation, zeroing and a page-table entry per 4 KiB: 64 MiB copied into
        fresh slots took ~50 ms here against ~11 ms into mapped ones (BENCHMARKS.md, "Time to
        first token"). Nothing is written; the pages count as used from then on.

        Returns False (nothing started) where the kernel lacks MADV_POPULATE_WRITE (before
        Linux 5.14) or the region is closed; the copies are then as before, slower at first."""
        if self._prefault is not None or self._mmap is None:
            return self._prefault is not None
        madvise = _madvise()
        if madvise is None:
            return False
        layout = self.layout
        base = self.address
        if rank is None or layout.num_workers == 1:  # one worker's shards fill every slot
            total = layout.num_slots * layout.slot_stride
            ranges: Iterator[tuple[int, int]] = (
                (base + at, min(_PREFAULT_CHUNK, total - at))
                for at in range(0, total, _PREFAULT_CHUNK)
            )
        else:
            ranges = _shard_pages(base, layout, rank)  # listed on the thread, as it goes
        first = next(ranges, None)
        if first is None or madvise(first[0], first[1], _MADV_POPULATE_WRITE) != 0:
            log.debug("primary region %s: MADV_POPULATE_WRITE unavailable", self.path)
            return False
        stop = self._stop_prefault

        def run() -> None:
            with contextlib.suppress(OSError):  # the engine's threads come first
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            for address, length in ranges:
                if stop.is_set() or madvise(address, length, _MADV_POPULATE_WRITE) != 0:
                    return

        self._prefault = threading.Thread(target=run, name="kvtier-prefault", daemon=True)
        self._prefault.start()
        return True

    def prefault_done(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` seconds for the prefault; whether it has ended (or none runs)."""
        thread = self._prefault
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    # -- CUDA -----------------------------------------------------------------------------------

    def pin(self) -> bool:
        """Register the slots with the CUDA driver (page-locked, for async DMA). Idempotent.

        Returns False, and the copies stay pageable (slower, still correct), when CUDA is not
        available or registration fails.
        """
        if self._pinned_ptr is not None:
            return True
        try:
            import torch

            if not torch.cuda.is_available():
                return False
            ptr = self.address
            size = self.layout.num_slots * self.layout.slot_stride
            err = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)  # type: ignore[no-untyped-call]
            if int(err) != 0:
                log.warning("primary region %s: cudaHostRegister failed (%s)", self.path, err)
                return False
        except Exception as e:  # a driver problem must not stop the engine: copies stay pageable
            log.warning("primary region %s: cannot pin: %s", self.path, e)
            return False
        self._pinned_ptr = ptr
        return True

    def unpin(self) -> None:
        if self._pinned_ptr is None:
            return
        import torch

        torch.cuda.cudart().cudaHostUnregister(self._pinned_ptr)  # type: ignore[no-untyped-call]
        self._pinned_ptr = None

    @property
    def pinned(self) -> bool:
        return self._pinned_ptr is not None


class _RegionExists(RegionError):
    """A live process holds a region of that name (internal: `open` joins it)."""


def region_path(name: str, directory: Path) -> Path:
    if not isinstance(name, str) or not _NAME.match(name):
        raise RegionError(
            f"primary region name {name!r}: use 1-128 letters, digits, '.', '_' or '-'"
        )
    return directory / f"{_PREFIX}{name}{_SUFFIX}"


def cleanup_stale(directory: str | Path = DEFAULT_DIRECTORY) -> list[Path]:
    """Remove region files in `directory` whose creator is dead; return what was removed."""
    removed = []
    for path in Path(directory).glob(f"{_PREFIX}*{_SUFFIX}"):
        pid = _creator_pid(path)
        if pid is not None and not _alive(pid):
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            except OSError as e:
                log.warning("primary region %s: stale, but cannot remove it: %s", path, e)
                continue
            log.warning("primary region %s: removed, its creator (pid %d) is gone", path, pid)
            removed.append(path)
    return removed


def _read_header(path: Path) -> tuple[bool, RegionLayout, bytes] | None:
    try:
        with open(path, "rb") as f:
            raw = f.read(_HEADER.size)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise RegionError(f"primary region {path}: cannot read: {e.strerror}") from e
    if len(raw) < _HEADER.size:
        return None  # being created
    magic, version, ready, _pid, slots, shard, workers, _stride, token = _HEADER.unpack(raw)
    if magic != _MAGIC or version != _VERSION:
        raise RegionError(f"primary region {path}: not a kvtier region of version {_VERSION}")
    return bool(ready), RegionLayout(slots, shard, workers), token


def _creator_pid(path: Path) -> int | None:
    try:
        with open(path, "rb") as f:
            raw = f.read(_HEADER.size)
    except OSError:
        return None
    if len(raw) < _HEADER.size or raw[:8] != _MAGIC:
        return None
    return int(_HEADER.unpack(raw)[3])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError as e:
        return e.errno != errno.ESRCH
    return True


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _madvise() -> Any:
    """libc's madvise through ctypes (a foreign call: the GIL is released while the kernel
    maps), or None where there is no libc to call."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    function = libc.madvise
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def _shard_pages(base: int, layout: RegionLayout, rank: int) -> Iterator[tuple[int, int]]:
    """(address, length) of the pages holding worker `rank`'s shard of each slot, merged where
    consecutive slots' ranges touch, in chunks of at most `_PREFAULT_CHUNK`."""
    start = rank * layout.shard_bytes
    run_start = run_end = -1
    for slot in range(layout.num_slots):
        first = base + slot * layout.slot_stride + start
        low = first - first % PAGE
        high = first + layout.shard_bytes
        high += -high % PAGE
        if low <= run_end:
            run_end = max(run_end, high)
        else:
            if run_end > run_start:
                yield run_start, run_end - run_start
            run_start, run_end = low, high
        while run_end - run_start > _PREFAULT_CHUNK:
            yield run_start, _PREFAULT_CHUNK
            run_start += _PREFAULT_CHUNK
    if run_end > run_start:
        yield run_start, run_end - run_start
