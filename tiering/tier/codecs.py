"""The payload codecs and checksums of stored objects (any thread: pure functions, and a
checksum computed over chunks by the one thread that reads or writes its object): what
`tiering.tier.format` compresses, decompresses with bounded output, and checksums."""

from __future__ import annotations

from typing import Final

import xxhash

from tiering.errors import ConfigError, CorruptObject, MissingDependencyError

__all__ = ["CHECKSUMS", "CODECS", "Checksum", "checksum", "compress", "decompress"]

CODECS: Final = ("raw", "lz4", "zstd")
CHECKSUMS: Final = ("xxh3", "crc32c")


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


class Checksum:
    """A payload checksum computed over chunks (`checksum` of their concatenation); used by
    one thread at a time, the one that reads or writes the object."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._xxh3 = xxhash.xxh3_64() if kind == "xxh3" else None
        self._crc = 0
        if kind != "xxh3":
            checksum(kind, b"")  # the kind is known and its package installed

    def update(self, data: bytes | memoryview) -> None:
        if self._xxh3 is not None:
            self._xxh3.update(data)
        else:
            import crc32c

            self._crc = int(crc32c.crc32c(data, self._crc))

    def value(self) -> int:
        return int(self._xxh3.intdigest()) if self._xxh3 is not None else self._crc


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
        return bytes(zstandard.ZstdCompressor(level=1, write_content_size=True).compress(data))
    raise ConfigError(f"codec: expected one of {', '.join(CODECS)}, got {codec!r}")


def decompress(codec: str, data: bytes | memoryview, raw_length: int) -> bytes | memoryview:
    """The block of a verified payload, its output bounded by `raw_length`: a payload that
    decodes to anything but exactly `raw_length` bytes is `CorruptObject`, and decoding stops (or
    never starts) past that, so a compression bomb costs nothing."""
    if codec == "raw":
        if len(data) != raw_length:
            raise CorruptObject(
                "length", f"raw payload of {len(data)} bytes, header says {raw_length}"
            )
        return data
    try:
        if codec == "lz4":
            import lz4.frame

            decoder = lz4.frame.LZ4FrameDecompressor()
            out = decoder.decompress(data, max_length=raw_length + 1)
            whole = decoder.eof and not decoder.unused_data
        else:
            import zstandard

            # With a content size in the frame, python-zstandard allocates that much whatever
            # max_output_size says: check it first (kvtier's writer always records it).
            size = zstandard.frame_content_size(data)
            if size != raw_length:
                raise CorruptObject(
                    "length", f"zstd frame of {size} bytes (-1: unknown), header says {raw_length}"
                )
            out = zstandard.ZstdDecompressor().decompress(
                data, max_output_size=raw_length, allow_extra_data=False
            )  # one frame and nothing after it, as kvtier writes it
            whole = True
    except ImportError as e:
        raise MissingDependencyError(f"reading {codec} objects needs its package") from e
    except CorruptObject:
        raise
    except Exception as e:  # each library has its own error types for bad input
        raise CorruptObject("checksum", f"{codec} payload does not decompress: {e}") from e
    if len(out) != raw_length or not whole:
        raise CorruptObject(
            "length", f"{codec} payload does not decode to the {raw_length} bytes claimed"
        )
    return bytes(out)
