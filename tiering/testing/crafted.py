"""Objects a stranger with write access to a tier's store can plant, and what refusing one may
cost: the attacks of the conformance suite (`tiering.testing.tier`), pytest-free.

Each object here has a header that is self-consistent (valid header and payload checksums,
which anyone can compute) and lies about the payload: empty, short, long, huge claimed
lengths, offsets past the end, another block's key, compression bombs. A tier must refuse each
as a counted miss, delete it unless it is read-only, and spend no more than `PEAK_BYTES` of
memory on it whatever it claims (`peak_memory` measures that).
"""

from __future__ import annotations

import hashlib
import hmac
import tracemalloc
from collections.abc import Awaitable
from typing import TypeVar

import xxhash

from tiering.keys import FORMAT_VERSION, BlockKey
from tiering.testing.data import NAMESPACE, OTHER_NAMESPACE, key, payload
from tiering.tier import Tier
from tiering.tier.format import (
    CODECS,
    FIXED_FIELDS,
    MAGIC,
    MAX_BLOCK_BYTES,
    checksum,
    encode,
    mac_key,
)

__all__ = [
    "CRAFTED_BLOCK",
    "LARGE_OBJECT",
    "PEAK_BYTES",
    "corrupt_variants",
    "craft",
    "crafted_objects",
    "peak_memory",
    "stored_object",
    "with_payload",
]

T = TypeVar("T")

PEAK_BYTES = 8 << 20
"""The most memory (traced by tracemalloc) one refused read of a crafted object may take, whatever
it claims: a read allocates at most what a block of the caller's size allows."""
CRAFTED_BLOCK = 256 << 10
"""Block size of the crafted-object tests (a typical offload block)."""
LARGE_OBJECT = 32 << 20
"""Size of the oversized objects planted by the default `raw_put_large` (a stand-in for the
2 GiB sparse file a file tier's hook plants)."""


def craft(
    k: BlockKey,
    payload: bytes,
    *,
    namespace: bytes = NAMESPACE,
    codec: str = "raw",
    stored: int | None = None,
    raw: int | None = None,
    offset: int | None = None,
    align: int = 1,
    checksum_of: bytes | None = None,
    mac_secret: bytes | None = None,
) -> bytes:
    """An object whose header says what the arguments say, with valid header and payload
    checksums (what anyone can compute): `stored`/`raw` lengths default to the payload's,
    `offset` to the aligned end of the header, the checksum to the payload's own. Written apart
    from `encode` on purpose: an attacker's object must not share the writer's bugs."""
    stored = len(payload) if stored is None else stored
    raw = stored if raw is None else raw
    kind = 0x80 if mac_secret is not None else 0
    header_end = 66 + len(k) + (32 if mac_secret is not None else 0)
    offset = -(-header_end // align) * align if offset is None else offset
    fields = FIXED_FIELDS.pack(
        MAGIC,
        FORMAT_VERSION,
        CODECS.index(codec),
        kind,
        len(k),
        offset,
        namespace,
        stored,
        raw,
        checksum("xxh3", payload if checksum_of is None else checksum_of),
        0,
    )
    header = fields[:58] + xxhash.xxh3_64_intdigest(fields[:58] + k).to_bytes(8, "little") + k
    if mac_secret is not None:
        header += hmac.new(mac_key(mac_secret), header + payload, hashlib.sha256).digest()
    header += bytes(max(0, min(offset, 1 << 16) - len(header)))
    return header + payload


def with_payload(blob: bytes, payload: bytes) -> bytes:
    """`blob` (a crafted object) with its payload replaced and both checksums recomputed, its
    MAC left as it was: what an attacker who cannot compute MACs can do."""
    offset = int.from_bytes(blob[14:18], "little")
    key_len = int.from_bytes(blob[12:14], "little")
    header = bytearray(blob[:offset])
    header[50:58] = checksum("xxh3", payload).to_bytes(8, "little")
    key_bytes = bytes(header[66 : 66 + key_len])
    header[58:66] = xxhash.xxh3_64_intdigest(bytes(header[:58]) + key_bytes).to_bytes(8, "little")
    return bytes(header) + payload


def stored_object(tier: Tier, k: BlockKey, data: bytes, namespace: bytes | None = None) -> bytes:
    """The object `tier` stores for block `data` at `k` (written by kvtier's own encoder)."""
    header, body = encode(k, namespace or tier.namespace, data, align=tier.align)
    return header + bytes(body)


def corrupt_variants(tier: Tier, k: BlockKey, data: bytes) -> dict[str, bytes]:
    """Damaged or foreign objects for block `data` at `k`: reason they are refused -> bytes."""
    good = stored_object(tier, k, data)
    flipped = bytearray(good)
    flipped[-1] ^= 0xFF
    old_version = bytearray(good)
    old_version[8:10] = (99).to_bytes(2, "little")
    return {
        "checksum": bytes(flipped),
        "truncated": good[:-7],
        "namespace": stored_object(tier, k, data, namespace=OTHER_NAMESPACE),
        "version": bytes(old_version),
        "magic": b"garbage" * 20,
        "key": stored_object(tier, key(12345), data),
    }


def crafted_objects(tier: Tier, k: BlockKey, size: int) -> dict[str, tuple[str, bytes]]:
    """Objects for a block of `size` at `k` that must each be refused: name -> (reason,
    object bytes). Each header is self-consistent (valid checksums) and lies."""
    import lz4.frame
    import zstandard

    data = payload(size, 11)
    align = tier.align
    good = stored_object(tier, k, data)
    lz4_bomb = lz4.frame.compress(bytes(128 * size), store_size=False)
    zstd_bomb = zstandard.ZstdCompressor().compress(bytes(256 * size))
    zstd_unsized = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(256 * size))
    return {
        # the hole that served stale slot bytes as a hit: raw, stored 0, raw = block size
        "empty": ("length", craft(k, b"", raw=size, align=align)),
        "short": ("truncated", craft(k, data[: size // 2], stored=size, align=align)),
        # cut at its payload offset, with the checksum of the caller's (zeroed) buffer:
        # once taken for "header read, payload placed", the untouched buffer served
        "header only": (
            "truncated",
            craft(k, b"", stored=size, raw=size, checksum_of=bytes(size), align=align),
        ),
        "long": ("length", good + b"\0" * 4096),
        "huge claimed length": (
            "length",
            craft(k, data, stored=1 << 40, raw=1 << 40, checksum_of=data, align=align),
        ),
        "claimed block larger than any": (
            "length",
            craft(k, data, raw=MAX_BLOCK_BYTES + 1, align=align, stored=size),
        ),
        "stored longer than raw": (
            "length",
            craft(k, data + b"xx", codec="lz4", raw=size, align=align),
        ),
        "offset past the end": ("length", craft(k, data, offset=1 << 30, align=align)),
        "offset inside the payload": (
            "truncated",
            craft(k, data, offset=60_000)[: 66 + len(k)] + data,
        ),
        "key of another block": ("key", stored_object(tier, key(424242), data)),
        "lz4 bomb": ("length", craft(k, lz4_bomb, codec="lz4", raw=size, align=align)),
        "zstd bomb": ("length", craft(k, zstd_bomb, codec="zstd", raw=size, align=align)),
        "zstd bomb without size": (
            "length",
            craft(k, zstd_unsized, codec="zstd", raw=size, align=align),
        ),
    }


async def peak_memory(call: Awaitable[T]) -> tuple[T, int]:
    """`call`'s result and the peak of memory traced while it ran (bytes above the start)."""
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        result = await call
        return result, tracemalloc.get_traced_memory()[1] - base
    finally:
        if started:
            tracemalloc.stop()
