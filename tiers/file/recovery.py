"""The segment layout's start-up scan: the index rebuilt from the segment files on disk.

Each object's header is read in file order (the header carries its own checksum); where no
header parses, the scan steps 4 KiB and looks again, so a hole left by a crash costs time,
never later blocks. Holes and a preallocated zero tail are skipped without reading them where
the file system can say where data is (`SEEK_DATA`). The caller asks for payloads to be
verified too in the segments a crash can have left half-written (the two newest), a chunk at a
time and at most the bytes the file holds on disk in all (its allocated blocks). A payload with
a hole in it (`SEEK_HOLE`: a sparse file's hole, or an allocated extent never written, which
is what `fallocate` leaves) was never written whole: it is damaged without being read, so the
reads are bounded by the data written, whatever the headers claim and however large the file
is allocated or stretched. Of two copies of a key, the later one wins, as in the index before
the restart; a tombstone keeps a deleted block deleted.
"""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Callable

from tiering.errors import CorruptObject
from tiering.tier.format import HEADER_MIN, Checksum, Header, decode_header, peek_key
from tiers.file.direct import BLOCK
from tiers.file.ledger import Place, Segment, SegmentLedger, record_size

__all__ = ["TOMB", "TOMBSTONE", "scan_segment"]

TOMBSTONE = b"KVTIERDEAD\x00\x01"
"""What a delete writes over a dead object's header."""
TOMB = struct.Struct(f"<{len(TOMBSTONE)}sQ")
"""A tombstone: the marker, then the dead record's length."""
_CHUNK = 1 << 20


def scan_segment(
    segment: Segment,
    ledger: SegmentLedger,
    namespace: bytes,
    *,
    verify: bool,
    damaged: Callable[[int, str, str], None],
) -> None:
    """Place the objects of one segment file in `ledger`, in file order. With `verify`,
    payloads are checked too, a chunk at a time and at most the bytes the file holds in all:
    its size, or its allocated blocks where fewer (headers that claim the whole file, one after
    another, cost one pass, not one each; headers in the data of a sparse file that claim its
    holes cost nothing). What is left unchecked is checked by the reads, as every read is.
    `damaged(offset, reason, detail)` for each header that names a key but fails its checks.
    OSError when the file cannot be read."""
    with open(segment.path, "rb", buffering=0) as f:
        fd = f.fileno()
        # No read-ahead: pages read ahead over space allocated and never written would be
        # cached zeros, which `SEEK_DATA` and `SEEK_HOLE` then count as data.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        st = os.fstat(fd)
        end = st.st_size
        budget = min(end, st.st_blocks * 512) if verify else 0  # st_blocks: 512-byte units
        ledger.count_found(segment, end)
        offset = 0
        while offset + HEADER_MIN <= end:
            raw = os.pread(fd, BLOCK, offset)
            if not any(raw):  # a preallocated tail, or a hole: skip it a chunk at a time
                offset = _past_zeros(fd, offset, end)
                continue
            if raw.startswith(TOMBSTONE):
                offset += record_size(TOMB.unpack_from(raw)[1])
                continue
            key = peek_key(raw)
            try:
                if key is None:
                    raise CorruptObject("magic", "no object here")
                header = decode_header(raw, key, namespace)
                length = header.object_length
                if offset + length > end:
                    raise CorruptObject("truncated", f"object of {length} bytes at {offset}")
                if verify:
                    _written_whole(fd, offset + header.payload_offset, header.stored_length)
                if header.stored_length <= budget:
                    budget -= header.stored_length
                    _verify_in_place(fd, header, offset + header.payload_offset)
            except CorruptObject as e:
                if key is not None:  # a header that named a key: worth a word
                    damaged(offset, e.reason, str(e))
                offset += BLOCK
                continue
            ledger.place(key, Place(segment, offset, length))
            offset += record_size(length)


def _written_whole(fd: int, at: int, length: int) -> None:
    """`CorruptObject("truncated")` if the `length` bytes at `at` in `fd` have a hole: a crash
    between a header's write and its payload's, or a stranger's header over space allocated and
    never written (the file system counts it allocated, and reads it as zeros as fast as it
    can: seconds per GiB). A file system that cannot tell (EINVAL) is taken at its word."""
    try:
        hole = os.lseek(fd, at, os.SEEK_HOLE)
    except OSError:
        return
    if hole < at + length:
        raise CorruptObject("truncated", f"the payload has a hole (never written) at {hole}")


def _verify_in_place(fd: int, header: Header, at: int) -> None:
    """Check the checksum of the payload `header` describes, at `at` in `fd`, reading it a
    chunk at a time (a header may claim up to 1 GiB)."""
    digest = Checksum(header.checksum_kind)
    left = header.stored_length
    while left:
        chunk = os.pread(fd, min(left, _CHUNK), at)
        if not chunk:
            raise CorruptObject("truncated", "the segment ends inside a payload")
        digest.update(chunk)
        at += len(chunk)
        left -= len(chunk)
    if digest.value() != header.payload_checksum:
        raise CorruptObject("checksum", "payload checksum mismatch")


def _past_zeros(fd: int, offset: int, end: int) -> int:
    """The first block-aligned offset at or after `offset` whose block is not all zeros (or
    `end`). Holes are skipped without reading them (`SEEK_DATA`), and a read stops at the next
    hole (`SEEK_HOLE`): a sparse or preallocated file of any size costs system calls, not a
    read of its zeros."""
    while offset < end:
        try:
            data = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError:  # no data after `offset` (ENXIO), or no SEEK_DATA here: read on
            data = end if _no_data_after(fd, offset) else offset
        if data // BLOCK * BLOCK > offset:
            offset = min(end, data // BLOCK * BLOCK)
            continue
        try:
            hole = os.lseek(fd, data, os.SEEK_HOLE)
        except OSError:
            hole = end
        chunk = os.pread(fd, min(_CHUNK, max(BLOCK, hole - offset)), offset)
        if not chunk:
            return end
        stripped = chunk.lstrip(b"\0")
        if stripped:
            return offset + (len(chunk) - len(stripped)) // BLOCK * BLOCK
        offset += len(chunk)
    return end


def _no_data_after(fd: int, offset: int) -> bool:
    """Whether `SEEK_DATA` from `offset` said there is no data after it (ENXIO), rather than
    that the file system cannot tell (EINVAL and the like)."""
    try:
        os.lseek(fd, offset, os.SEEK_DATA)
    except OSError as e:
        return e.errno == errno.ENXIO
    return False
