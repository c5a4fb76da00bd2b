"""A file tier's records (`tiering.tier.records`), in its pool's threads: one file each,
`<path>/.kvtier/records/<namespace>.<name>`, beside the namespaces' directories and never in
one (a namespace's directory holds blocks only: its index, sweeper and usage never see a
record).

A record is written to a temporary name in the same directory, flushed (`fsync`, always: a
record is small and written rarely, and a manifest that a power cut leaves empty is worse
than an old one), then renamed over the old one: a reader, or the next engine after a kill -9
at any moment, finds the old record or the new one, whole. A leftover temporary file (a
writer killed before its rename) is replaced by the next write of the same writer's name and
never read. A listing reads the records' directory once (its names only: one `scandir`),
keeping this namespace's names and never a temporary file's.
"""

from __future__ import annotations

import os
from pathlib import Path

from tiering.errors import CorruptObject
from tiers.file.locks import meta_dir, open_regular

__all__ = ["delete_record", "list_records", "read_record", "write_record"]

RECORDS = "records"


def _where(base: Path, namespace: bytes, name: str, *, create: bool) -> Path | None:
    meta = meta_dir(base, create=create)
    if meta is None:
        return None
    folder = meta / RECORDS
    if create:
        folder.mkdir(mode=0o755, exist_ok=True)
    elif not folder.is_dir():
        return None
    return folder / f"{namespace.hex()}.{name}"


def read_record(base: Path, namespace: bytes, name: str, limit: int) -> bytes | None:
    """The record's object, None when there is none; `CorruptObject("length")` past `limit`
    bytes, unread."""
    path = _where(base, namespace, name, create=False)
    if path is None:
        return None
    fd = open_regular(path, create=False)
    if fd is None:
        return None
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CorruptObject("length", f"record of {size} bytes, at most {limit} expected")
        chunks = []
        while size > 0:
            chunk = os.read(fd, size)
            if not chunk:
                break
            chunks.append(chunk)
            size -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_record(base: Path, namespace: bytes, name: str, blob: bytes) -> bool:
    """Write the record (temporary file, fsync, rename, directory fsync); always True."""
    path = _where(base, namespace, name, create=True)
    if path is None:
        raise OSError(f"{base}: kvtier's directory cannot be made")
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(blob)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
    return True


def delete_record(base: Path, namespace: bytes, name: str) -> bool:
    """Remove the record; whether it was there."""
    path = _where(base, namespace, name, create=False)
    if path is None:
        return False
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def list_records(base: Path, namespace: bytes, prefix: str, limit: int) -> list[str]:
    """The names of `namespace`'s records starting with `prefix`, at most `limit` (the first
    the directory's listing meets)."""
    meta = meta_dir(base, create=False)
    if meta is None or not (meta / RECORDS).is_dir():
        return []
    start = f"{namespace.hex()}.{prefix}"
    found: list[str] = []
    with os.scandir(meta / RECORDS) as entries:
        for entry in entries:
            if entry.name.startswith(start) and entry.is_file(follow_symlinks=False):
                found.append(entry.name[len(namespace.hex()) + 1 :])
                if len(found) >= limit:
                    break
    return found
