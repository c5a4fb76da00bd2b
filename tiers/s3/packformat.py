"""The pack format (any thread: pure functions and constants): what one pack object holds, how
it is named, and how far a reader believes a pack's index.

A pack is a 4-byte big-endian index length, a JSON index of `key hex -> [offset, length]`
(offsets from the end of the index), then the objects back to back. Its name is
`<prefix><namespace hex>/packs/t<ms>-<writer>-<n>`: `<ms>` the server's clock in milliseconds
when the pack was named (12 hex digits), so that names sort by time and a reader lists only the
packs named since its last listing (`StartAfter`); `<writer>` the writing tier's id and `<n>` its
count of packs. Names of older kvtier versions (32 hex digits) sort before every `t` name and
are read alike.

Anyone who can write to the bucket can plant a pack, so what an index costs is bounded:
`MAX_PACK_INDEX` bytes, `MAX_PACK_ENTRIES` entries. An index beyond a bound, or that is not what
kvtier writes, is refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from tiering.errors import KeyFormatError
from tiering.keys import BlockKey, key_from_hex

__all__ = [
    "MAX_PACK_ENTRIES",
    "MAX_PACK_INDEX",
    "PACK_HEAD",
    "encode_index",
    "name_after",
    "pack_entries",
    "pack_name",
]

MAX_PACK_ENTRIES = 4096
"""Entries a pack's index may hold: the most `blocks_per_object` allows."""
MAX_PACK_INDEX = 1 << 20
"""Bytes a pack's index may claim: an entry kvtier writes takes at most ~170 bytes (a key of
68 bytes in hex, two offsets), so `MAX_PACK_ENTRIES` of them fit. A larger claim is refused
unread."""
PACK_HEAD = 16 << 10
"""Bytes read from the start of a pack to find its index: one GET for any pack of up to ~100
blocks, a second for a larger index."""


def encode_index(items: Iterable[tuple[BlockKey, int]]) -> tuple[bytes, dict[BlockKey, int]]:
    """The head of a pack of objects of the given (key, size), in order (the index length and
    the index), and where each object starts in the pack."""
    index: dict[str, list[int]] = {}
    at = 0
    sizes = []
    for key, size in items:
        index[key.hex()] = [at, size]
        sizes.append((key, at))
        at += size
    text = json.dumps(index, separators=(",", ":")).encode()
    head = len(text).to_bytes(4, "big") + text
    return head, {key: len(head) + offset for key, offset in sizes}


def pack_name(prefix: str, server_time: float, writer: bytes, count: int) -> str:
    """The name of a new pack under `prefix` (the namespace's `packs/`), named at
    `server_time` (Unix seconds of the server's clock) by `writer`'s `count`th pack."""
    return f"{prefix}t{max(0, int(server_time * 1000)):012x}-{writer.hex()}-{count:x}"


def name_after(prefix: str, server_time: float) -> str:
    """The name a listing starts after to find every pack named at `server_time` or later
    (and every name of a pack named later sorts after it)."""
    return f"{prefix}t{max(0, int(server_time * 1000)):012x}"


def pack_entries(head: bytes, room: int) -> list[tuple[BlockKey, int, int]] | None:
    """A pack index's entries (key, offset, length), each range inside the `room` bytes after
    the index; None when it is not an index kvtier writes: a flat JSON object of at most
    `MAX_PACK_ENTRIES` entries, one list each (counted before parsing, so a wide index costs
    no parse; a deep one makes the parser raise RecursionError)."""
    if head.count(b"[") > MAX_PACK_ENTRIES:
        return None
    try:
        index = json.loads(head)
    except (ValueError, RecursionError):
        return None
    if not isinstance(index, dict) or not index:
        return None
    entries = []
    for text, where in index.items():
        if not (
            isinstance(where, list)
            and len(where) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in where)
            and where[0] + where[1] <= room
        ):
            return None
        try:
            entries.append((key_from_hex(text), where[0], where[1]))
        except KeyFormatError:
            return None
    return entries
