"""The self-describing object every secondary tier stores.

    offset  size  field
    0       8     magic b"KVTIEROB"
    8       2     format version (`tiering.keys.FORMAT_VERSION`)
    10      1     codec: 0 raw, 1 lz4, 2 zstd
    11      1     checksum: 0 xxh3-64, 1 crc32c
    12      2     key length k
    14      4     payload offset (>= 66 + k; a file tier pads to 4 KiB for O_DIRECT)
    18      16    namespace digest
    34      8     stored payload length (after compression)
    42      8     raw payload length (before compression)
    50      8     payload checksum (of the stored payload)
    58      8     header checksum (xxh3-64 of bytes 0..57 and the key)
    66      k     key
    ...           zero padding up to the payload offset
            n     payload

Reading verifies everything: magic, version, header checksum, namespace, key, codec, length and
payload checksum. Any mismatch raises `CorruptObject` with a short `reason`; tiers turn that into
a miss, delete the object where they may, and count it by reason. All integers little-endian.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

import xxhash

from tiering.errors import ConfigError, CorruptObject, MissingDependencyError
from tiering.keys import FORMAT_VERSION, NAMESPACE_BYTES, BlockKey

__all__ = [
    "CHECKSUMS",
    "CODECS",
    "HEADER_MIN",
    "MAGIC",
    "Header",
    "decode_header",
    "encode",
    "peek_key",
    "peek_lengths",
    "verify_payload",
]

MAGIC: Final = b"KVTIEROB"
_FIXED = struct.Struct("<8sHBBHI16sQQQQ")
HEADER_MIN: Final = _FIXED.size  # 66, before the key
CODECS: Final = ("raw", "lz4", "zstd")
CHECKSUMS: Final = ("xxh3", "crc32c")

REASONS: Final = (
    "magic",
    "version",
    "header",
    "namespace",
    "key",
    "codec",
    "truncated",
    "checksum",
)
"""Why an object was refused (`CorruptObject.reason`), for metrics."""


class Corrupt(CorruptObject):
    """A stored object that fails verification; `reason` is one of `REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Header:
    key: BlockKey
    namespace: bytes
    codec: str
    checksum_kind: str
    payload_offset: int
    stored_length: int
    raw_length: int
    payload_checksum: int

    @property
    def object_length(self) -> int:
        return self.payload_offset + self.stored_length


def checksum(kind: str, data: bytes | memoryview) -> int:
    if kind == "xxh3":
        return int(xxhash.xxh3_64_intdigest(data))
    if kind == "crc32c":
        try:
            import crc32c
        except ImportError as e:
            raise MissingDependencyError(
                "checksum 'crc32c' needs the crc32c package: pip install crc32c"
            ) from e
        return int(crc32c.crc32c(data))
    raise ConfigError(f"checksum: expected one of {', '.join(CHECKSUMS)}, got {kind!r}")


def compress(codec: str, data: bytes | memoryview) -> bytes | memoryview:
    if codec == "raw":
        return data
    if codec == "lz4":
        try:
            import lz4.frame
        except ImportError as e:
            raise MissingDependencyError(
                "codec 'lz4' needs the lz4 package: pip install lz4"
            ) from e
        return bytes(lz4.frame.compress(data, store_size=True))
    if codec == "zstd":
        try:
            import zstandard
        except ImportError as e:
            raise MissingDependencyError(
                "codec 'zstd' needs the zstandard package: pip install zstandard"
            ) from e
        return bytes(zstandard.ZstdCompressor(level=1).compress(data))
    raise ConfigError(f"codec: expected one of {', '.join(CODECS)}, got {codec!r}")


def decompress(codec: str, data: bytes | memoryview, raw_length: int) -> bytes | memoryview:
    if codec == "raw":
        return data
    try:
        if codec == "lz4":
            import lz4.frame

            out = lz4.frame.decompress(data)
        else:
            import zstandard

            out = zstandard.ZstdDecompressor().decompress(data, max_output_size=raw_length)
    except ImportError as e:
        raise MissingDependencyError(f"reading {codec} objects needs its package") from e
    except Exception as e:  # each library has its own error types for bad input
        raise Corrupt("checksum", f"{codec} payload does not decompress: {e}") from e
    if len(out) != raw_length:
        raise Corrupt("truncated", f"decompressed to {len(out)} bytes, header says {raw_length}")
    return bytes(out)


def encode(
    key: BlockKey,
    namespace: bytes,
    data: bytes | memoryview,
    *,
    codec: str = "raw",
    checksum_kind: str = "xxh3",
    align: int = 1,
) -> tuple[bytes, bytes | memoryview]:
    """The header (padded so the payload starts at a multiple of `align`) and the payload.

    The two parts are returned apart so a tier can write them without joining them (a file
    tier's `pwritev`); `b"".join(parts)` is the object. With codec `raw` the payload is `data`
    itself, not a copy.
    """
    if len(namespace) != NAMESPACE_BYTES:
        raise ValueError(f"namespace must be {NAMESPACE_BYTES} bytes, got {len(namespace)}")
    payload = compress(codec, data)
    payload_sum = checksum(checksum_kind, payload)
    offset = HEADER_MIN + len(key)
    offset = -(-offset // align) * align
    fields = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        CODECS.index(codec),
        CHECKSUMS.index(checksum_kind),
        len(key),
        offset,
        namespace,
        len(payload),
        len(data),
        payload_sum,
        0,
    )
    header_sum = xxhash.xxh3_64_intdigest(fields[:58] + key)
    header = fields[:58] + header_sum.to_bytes(8, "little") + key
    return header + bytes(offset - len(header)), payload


def decode_header(raw: bytes | memoryview, expect_key: BlockKey, expect_namespace: bytes) -> Header:
    """Parse and check a header (from the start of an object; at least `HEADER_MIN + key`
    bytes). Raises `Corrupt` on any mismatch."""
    raw = memoryview(raw)
    if len(raw) < HEADER_MIN:
        raise Corrupt("truncated", f"{len(raw)} bytes is shorter than a header")
    (
        magic,
        version,
        codec,
        kind,
        key_len,
        offset,
        namespace,
        stored,
        raw_len,
        payload_sum,
        header_sum,
    ) = _FIXED.unpack_from(raw)
    if magic != MAGIC:
        raise Corrupt("magic", "not a kvtier object")
    if version != FORMAT_VERSION:
        raise Corrupt("version", f"format version {version}, this kvtier reads {FORMAT_VERSION}")
    if len(raw) < HEADER_MIN + key_len:
        raise Corrupt("truncated", "the header's key is cut short")
    key = bytes(raw[HEADER_MIN : HEADER_MIN + key_len])
    if xxhash.xxh3_64_intdigest(bytes(raw[:58]) + key) != header_sum:
        raise Corrupt("header", "header checksum mismatch")
    if namespace != expect_namespace:
        raise Corrupt(
            "namespace", f"namespace {namespace.hex()}, expected {expect_namespace.hex()}"
        )
    if key != expect_key:
        raise Corrupt("key", f"object holds key {key.hex()}")
    if codec >= len(CODECS) or kind >= len(CHECKSUMS) or offset < HEADER_MIN + key_len:
        raise Corrupt("codec", f"unknown codec {codec} or checksum {kind}, or bad offset {offset}")
    return Header(
        BlockKey(key),
        namespace,
        CODECS[codec],
        CHECKSUMS[kind],
        offset,
        stored,
        raw_len,
        payload_sum,
    )


def peek_lengths(raw: bytes | memoryview) -> tuple[int, int] | None:
    """(payload offset, stored payload length) of a header, unverified; None if it is not one.
    For backends that read the header first to place the payload; `decode_header` verifies."""
    if len(raw) < HEADER_MIN or bytes(raw[:8]) != MAGIC:
        return None
    fields = _FIXED.unpack_from(raw)
    return int(fields[5]), int(fields[7])


def peek_key(raw: bytes | memoryview) -> BlockKey | None:
    """The key a header names, unverified; None if `raw` does not start with one. For backends
    that find objects without knowing their keys (a scan); `decode_header` verifies."""
    if len(raw) < HEADER_MIN or bytes(raw[:8]) != MAGIC:
        return None
    key_len = int(_FIXED.unpack_from(raw)[4])
    if len(raw) < HEADER_MIN + key_len:
        return None
    return BlockKey(bytes(raw[HEADER_MIN : HEADER_MIN + key_len]))


def verify_payload(header: Header, payload: bytes | memoryview) -> None:
    """Check the stored payload's length and checksum against its header."""
    if len(payload) != header.stored_length:
        raise Corrupt(
            "truncated", f"payload of {len(payload)} bytes, header says {header.stored_length}"
        )
    if checksum(header.checksum_kind, payload) != header.payload_checksum:
        raise Corrupt("checksum", "payload checksum mismatch")
