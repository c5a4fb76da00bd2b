"""Any thread (the pool's): a finished temporary file given its final name only if that name is
free, atomically, so that engines writing the same block at once write it once between them.

`renameat2(RENAME_NOREPLACE)` (Linux 3.15; ext4, XFS, btrfs, tmpfs) does it in one call; where
the file system refuses the flag, a hard link to the final name (which fails when the name
exists) and the temporary name's removal do; where it has no hard links either, a plain rename
does (the last of two writers at the same moment wins: the same block's bytes). Either way a
reader sees the whole object or none, and a name already taken is left as it is: its object is
another engine's (or an earlier run's), which a reader judges (a damaged one is removed by the
reader that proves it so, and the next put writes the block).
"""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

__all__ = ["place_once"]

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_unsupported = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


def _load() -> object | None:
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a C library without it (glibc before 2.28)
        return None
    function.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    function.restype = ctypes.c_int
    return function


_renameat2 = _load()


def place_once(tmp: Path, final: Path) -> bool:
    """Give the file at `tmp` the name `final` unless `final` exists; whether it did. Either
    way `tmp` is gone afterwards. `OSError` when the file system fails."""
    if _renameat2 is not None:
        done = _renameat2(  # type: ignore[operator]
            _AT_FDCWD, os.fsencode(tmp), _AT_FDCWD, os.fsencode(final), _RENAME_NOREPLACE
        )
        if done == 0:
            return True
        error = ctypes.get_errno()
        if error == errno.EEXIST:
            _remove(tmp)
            return False
        if error not in _unsupported:
            raise OSError(error, os.strerror(error), str(final))
    try:
        os.link(tmp, final)
    except FileExistsError:
        _remove(tmp)
        return False
    except OSError as e:
        if e.errno not in (errno.EPERM, *_unsupported):
            _remove(tmp)
            raise
        os.rename(tmp, final)  # no hard links here
        return True
    _remove(tmp)
    return True


def _remove(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
