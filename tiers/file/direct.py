"""O_DIRECT and the page cache: what both layouts of the file tier need to move bytes either way.

With O_DIRECT a transfer must start at a page-aligned address and move whole 4 KiB blocks;
`is_aligned` says whether a caller's buffer (a primary slot) can go as it is, `BounceBuffers`
gives each pool thread a reusable aligned buffer for everything else. Whether a directory
allows O_DIRECT is probed once per tier: by writing a probe file (`direct_supported`), or, for a
read-only tier, which writes nothing, by reading an object already there (`direct_readable`).
"""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import numpy as np

__all__ = [
    "BLOCK",
    "KEPT_BUFFER",
    "BounceBuffers",
    "direct_readable",
    "direct_supported",
    "is_aligned",
    "round_up",
    "unlink",
]

BLOCK = 4096
"""The O_DIRECT transfer unit and alignment; payloads start this far into an object."""
KEPT_BUFFER = 64 << 20
"""The largest bounce buffer a pool thread keeps for its next call."""


def round_up(size: int) -> int:
    """`size` rounded up to whole blocks."""
    return -(-size // BLOCK) * BLOCK


def is_aligned(view: memoryview) -> bool:
    """Whether O_DIRECT can move `view` as it is: page-aligned, whole 4 KiB blocks."""
    if len(view) == 0 or len(view) % BLOCK:
        return False
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) % BLOCK == 0


class BounceBuffers:
    """Any thread: one page-aligned buffer per thread, grown as needed and reused (a fresh
    mapping per call costs a page fault per 4 KiB)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, size: int) -> memoryview:
        """This thread's buffer, `size` bytes of it. A buffer over `KEPT_BUFFER` (an operator's
        read of a large block) is the caller's own, not kept afterwards."""
        if size > KEPT_BUFFER:
            return memoryview(mmap.mmap(-1, size))[:size]
        mapping: mmap.mmap | None = getattr(self._local, "mapping", None)
        if mapping is None or len(mapping) < size:
            mapping = mmap.mmap(-1, max(size, 1 << 20))
            self._local.mapping = mapping
        return memoryview(mapping)[:size]


def unlink(path: Path) -> bool:
    """Remove `path`; whether it was there."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def direct_readable(root: Path, objects: str) -> bool:
    """Whether the objects under `root` (the glob `objects`) can be read with O_DIRECT, found
    without writing: by reading the first block of one of them so (none: buffered)."""
    for path in root.glob(objects) if root.is_dir() else ():
        if not path.is_file():  # a FIFO would block the open
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_DIRECT)
        except OSError:
            return False
        try:
            os.preadv(fd, [mmap.mmap(-1, BLOCK)], 0)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)
    return False


def direct_supported(directory: Path) -> bool:
    """Whether files in `directory` can be written with O_DIRECT (tmpfs, for one, refuses)."""
    probe = directory / f".direct-probe-{os.getpid()}.tmp"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        buffer = mmap.mmap(-1, BLOCK)
        os.write(fd, buffer)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)
