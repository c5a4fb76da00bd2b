"""The primary region's file: its layout, its header, its name, and the removal of files no
process holds (any process, any thread: functions and a value type).

File layout (`<directory>/kvtier-<name>.region`, by default in /dev/shm):

    [ header: one page ][ slot 0 ][ slot 1 ] ... [ slot N-1 ]
    slot s  = [ worker 0 shard | worker 1 shard | ... | worker W-1 shard | pad to a page ]
    a shard = per KV tensor of that worker, in order: page_bytes x blocks_per_chunk bytes

The header records the layout, the creator's pid, a random token and a ready flag, which the
creator sets once the header is written: a process that finds the flag clear waits.

Every process that maps a region holds a shared `flock` on it (`hold`), the creator from before
it writes the header; a region is dead when nobody does (`cleanup_stale` gets the exclusive lock).
The kernel tells this to any process that sees the file, whatever its pid namespace: a pid is
only a name in its own (a container sharing /dev/shm sees no process of the host's), so the
creator's pid is never asked. A file of another version (whose writers may not hold the lock) is
left alone; one whose header is not ready yet is left for `BIRTH_GRACE` (its creator locks it
right after creating it).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from tiering.errors import RegionError

__all__ = [
    "DEFAULT_DIRECTORY",
    "PAGE",
    "TOKEN_BYTES",
    "RegionLayout",
    "cleanup_stale",
    "creator_pid",
    "held",
    "hold",
    "human_size",
    "read_header",
    "region_path",
    "write_header",
]

log = logging.getLogger("tiers.region")  # every line about the region under one logger

DEFAULT_DIRECTORY = Path("/dev/shm")
PAGE = mmap.PAGESIZE
_MAGIC = b"KVTIERRG"
_VERSION = 3
# magic, version, ready, creator pid, num_slots, shard_bytes, num_workers, slot_stride, token
_HEADER = struct.Struct("<8sIIQQQQQ16s")
TOKEN_BYTES = 16
_READY_OFFSET = 12
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z")
_PREFIX, _SUFFIX = "kvtier-", ".region"
BIRTH_GRACE = 60.0
"""Seconds a region whose header is not ready, and which nobody holds, is taken to be being
created (its creator between `open` and `hold`), not dead."""


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


def region_path(name: str, directory: Path) -> Path:
    if not isinstance(name, str) or not _NAME.match(name):
        raise RegionError(
            f"primary region name {name!r}: use 1-128 letters, digits, '.', '_' or '-'"
        )
    return directory / f"{_PREFIX}{name}{_SUFFIX}"


def write_header(fd: int, layout: RegionLayout, token: bytes) -> None:
    """Write the header of a new region with this process as its creator, then set its ready
    flag: joiners may map it from then on. Raises what `os.pwrite` raises."""
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
    os.pwrite(fd, struct.pack("<I", 1), _READY_OFFSET)


def read_header(path: Path) -> tuple[bool, RegionLayout, bytes] | None:
    """(ready, layout, token) from the header of the region at `path`; None while it does not
    exist or its header is not yet written (the creator sizes the file, zeros, before it
    writes the header). A file of another format or version is an error."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_HEADER.size)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise RegionError(f"primary region {path}: cannot read: {e.strerror}") from e
    if len(raw) < _HEADER.size or raw[: len(_MAGIC)] == bytes(len(_MAGIC)):
        return None  # being created: not yet sized, or sized and its header not yet written
    magic, version, ready, _pid, slots, shard, workers, _stride, token = _HEADER.unpack(raw)
    if magic != _MAGIC or version != _VERSION:
        raise RegionError(f"primary region {path}: not a kvtier region of version {_VERSION}")
    return bool(ready), RegionLayout(slots, shard, workers), token


def creator_pid(path: Path) -> int | None:
    """The pid of the process that created the region at `path`; None if it cannot be read."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_HEADER.size)
    except OSError:
        return None
    if len(raw) < _HEADER.size or raw[:8] != _MAGIC:
        return None
    return int(_HEADER.unpack(raw)[3])


def hold(fd: int) -> None:
    """Hold the region open on `fd` (a shared lock, for as long as `fd` stays open, in this
    process and the children that inherit it): the sign that a process maps it."""
    fcntl.flock(fd, fcntl.LOCK_SH)


def held(path: Path) -> bool | None:
    """Whether a process holds the region at `path` (None: no such file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:
        return True  # cannot tell: taken as held
    try:
        return not _try_exclusive(fd)
    finally:
        os.close(fd)


def cleanup_stale(directory: str | Path = DEFAULT_DIRECTORY) -> list[Path]:
    """Remove the region files in `directory` that no process holds; return what was removed."""
    removed = []
    for path in Path(directory).glob(f"{_PREFIX}*{_SUFFIX}"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if not _try_exclusive(fd) or not _dead(fd):
                continue
            try:
                if not os.path.samestat(os.fstat(fd), os.stat(path)):
                    continue  # replaced meanwhile: that one is another's
                path.unlink()
            except FileNotFoundError:
                continue
            except OSError as e:
                log.warning("primary region %s: stale, but cannot remove it: %s", path, e)
                continue
        finally:
            os.close(fd)
        log.warning("primary region %s: removed, no process holds it", path)
        removed.append(path)
    return removed


def _try_exclusive(fd: int) -> bool:
    """Whether the exclusive lock on `fd` was free (it is then held until `fd` closes)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def _dead(fd: int) -> bool:
    """Whether the region on `fd`, which nobody holds, is dead: a ready header of this version,
    or one never made ready within `BIRTH_GRACE`. Other versions are left to their writers."""
    raw = os.pread(fd, _HEADER.size, 0)
    if len(raw) == _HEADER.size and raw[:8] == _MAGIC:
        version, ready = struct.unpack_from("<II", raw, 8)
        if version != _VERSION:
            return False
        if ready:
            return True
    elif len(raw) >= 8 and raw[:8] != _MAGIC:
        return False  # not a region of ours
    return time.time() - os.fstat(fd).st_mtime > BIRTH_GRACE


def human_size(size: int) -> str:
    """`size` bytes for a message: one decimal, in B, KiB, MiB, GiB or TiB."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
