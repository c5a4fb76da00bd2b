"""The on-tier object format."""

from __future__ import annotations

import pytest

from tiering.errors import ConfigError, CorruptObject
from tiering.format import HEADER_MIN, decode_header, encode, peek_lengths, verify_payload
from tiering.keys import FORMAT_VERSION, make_key

NS = bytes(range(16))
KEY = make_key(bytes(32), 7)


@pytest.mark.parametrize("codec", ["raw", "lz4", "zstd"])
@pytest.mark.parametrize("checksum", ["xxh3", "crc32c"])
def test_round_trip(codec: str, checksum: str) -> None:
    data = b"kv" * 5000
    header, payload = encode(KEY, NS, data, codec=codec, checksum_kind=checksum)
    h = decode_header(header, KEY, NS)
    assert (h.key, h.namespace, h.codec, h.checksum_kind) == (KEY, NS, codec, checksum)
    assert h.raw_length == len(data) and h.stored_length == len(payload)
    assert h.payload_offset == len(header) == HEADER_MIN + len(KEY)
    verify_payload(h, payload)
    assert peek_lengths(header) == (len(header), len(payload))


def test_raw_payload_is_not_copied_and_alignment_pads_the_header() -> None:
    data = memoryview(bytearray(100))
    header, payload = encode(KEY, NS, data, align=4096)
    assert payload is data and len(header) == 4096
    assert decode_header(header, KEY, NS).payload_offset == 4096


def test_layout_of_the_fixed_fields() -> None:
    header, _ = encode(KEY, NS, b"abc")
    assert header[:8] == b"KVTIEROB"
    assert int.from_bytes(header[8:10], "little") == FORMAT_VERSION
    assert header[18:34] == NS and header[66:] == KEY


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda h: h[:40], "truncated"),
        (lambda h: b"X" + h[1:], "magic"),
        (lambda h: h[:8] + (2).to_bytes(2, "little") + h[10:], "version"),
        (lambda h: h[:40] + bytes([h[40] ^ 1]) + h[41:], "header"),  # a length bit flipped
    ],
)
def test_damaged_headers(mutate: object, reason: str) -> None:
    header, _ = encode(KEY, NS, b"abc")
    with pytest.raises(CorruptObject) as info:
        decode_header(mutate(header), KEY, NS)  # type: ignore[operator]
    assert info.value.reason == reason  # type: ignore[attr-defined]


def test_foreign_namespace_and_key() -> None:
    header, _ = encode(KEY, NS, b"abc")
    with pytest.raises(CorruptObject, match="namespace"):
        decode_header(header, KEY, bytes(16))
    with pytest.raises(CorruptObject, match="key"):
        decode_header(header, make_key(bytes(32), 8), NS)


def test_payload_checks() -> None:
    header, payload = encode(KEY, NS, b"abcdef")
    h = decode_header(header, KEY, NS)
    with pytest.raises(CorruptObject, match="truncated"):
        verify_payload(h, payload[:-1])
    with pytest.raises(CorruptObject, match="checksum"):
        verify_payload(h, b"abcdeF")


def test_bad_options() -> None:
    with pytest.raises(ConfigError, match="codec: expected one of raw, lz4, zstd"):
        encode(KEY, NS, b"x", codec="gzip")
    with pytest.raises(ConfigError, match="checksum: expected one of xxh3, crc32c"):
        encode(KEY, NS, b"x", checksum_kind="md5")
