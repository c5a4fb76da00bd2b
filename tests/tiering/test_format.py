"""The on-tier object format."""

from __future__ import annotations

import pytest

from tiering.errors import ConfigError, CorruptObject
from tiering.keys import FORMAT_VERSION, make_key
from tiering.tier.format import (
    FIXED_FIELDS,
    HEADER_MIN,
    REASONS,
    REMOVABLE,
    decode_header,
    encode,
    mac_key,
    peek_lengths,
    verify_payload,
)

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


def test_a_block_that_does_not_compress_is_stored_raw() -> None:
    import os

    data = os.urandom(10_000)
    header, payload = encode(KEY, NS, data, codec="lz4")
    h = decode_header(header, KEY, NS)
    assert h.codec == "raw" and payload is data and h.stored_length == h.raw_length


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"stored": 0}, "length"),  # raw, nothing stored for a 4 KiB block
        ({"stored": 100}, "length"),  # raw, stored differs from raw
        ({"codec": 1, "stored": 5000}, "length"),  # compressed, longer than the block
        ({"raw": (1 << 30) + 1, "stored": (1 << 30) + 1}, "length"),  # larger than any block
        ({"offset": 10}, "length"),  # before the end of the header
        ({"offset": 1 << 20}, "length"),  # far past any alignment
        ({"codec": 9}, "codec"),
    ],
)
def test_headers_that_lie_about_lengths(fields: dict[str, int], reason: str) -> None:
    import xxhash

    header, _ = encode(KEY, NS, bytes(4096))
    values = list(FIXED_FIELDS.unpack_from(header))
    names = {"codec": 2, "offset": 5, "stored": 7, "raw": 8}
    for name, value in fields.items():
        values[names[name]] = value
    fixed = FIXED_FIELDS.pack(*values)
    checked = xxhash.xxh3_64_intdigest(fixed[:58] + KEY).to_bytes(8, "little")
    with pytest.raises(CorruptObject) as info:
        decode_header(fixed[:58] + checked + KEY, KEY, NS)
    assert info.value.reason == reason  # type: ignore[attr-defined]


def test_the_object_size_must_match_its_header() -> None:
    from tiering.tier.format import check_object

    header, payload = encode(KEY, NS, b"abcdef")
    h = decode_header(header, KEY, NS)
    check_object(h, len(header) + 6, 6)
    for size, expected, reason in [
        (len(header) + 5, 6, "truncated"),
        (len(header) + 7, 6, "length"),
        (len(header) + 6, 7, "length"),
    ]:
        with pytest.raises(CorruptObject) as info:
            check_object(h, size, expected)
        assert info.value.reason == reason  # type: ignore[attr-defined]


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_decoding_is_bounded_by_the_claimed_length(codec: str) -> None:
    import tracemalloc

    from tiering.tier.format import compress, decompress

    bomb = compress(codec, bytes(64 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(CorruptObject, match="length"):
            decompress(codec, bomb, 4096)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20
    assert decompress(codec, compress(codec, bytes(4096)), 4096) == bytes(4096)


def test_macs() -> None:
    from tiering.tier.format import mac_key

    secret = mac_key(b"a deployment secret")
    header, payload = encode(KEY, NS, b"abcdef", secret_key=secret, align=4096)
    h = decode_header(header, KEY, NS)
    assert h.mac is not None and header[11] & 0x80
    verify_payload(h, payload, secret)
    verify_payload(h, payload)  # without a secret the MAC is not asked for
    with pytest.raises(CorruptObject, match="auth"):
        verify_payload(h, payload, mac_key(b"another secret entirely"))
    plain_header, _ = encode(KEY, NS, b"abcdef")
    with pytest.raises(CorruptObject, match="auth"):
        verify_payload(decode_header(plain_header, KEY, NS), payload, secret)


def test_a_zstd_payload_is_one_frame_and_nothing_after_it() -> None:
    import zstandard

    from tiering.tier.format import compress, decompress

    block = b"kv" * 2048
    frame = compress("zstd", block)
    skippable = (0x184D2A50).to_bytes(4, "little") + (8).to_bytes(4, "little") + b"8 bytes!"
    for extra in (b"GARBAGE!", zstandard.ZstdCompressor().compress(b"x"), skippable):
        with pytest.raises(CorruptObject):
            decompress("zstd", frame + extra, len(block))
    assert decompress("zstd", frame, len(block)) == block


@pytest.mark.parametrize("secret", [None, b"s" * 32], ids=["plain", "mac"])
@pytest.mark.parametrize("align", [1, 4096])
def test_the_writer_tag_rides_in_the_padding(secret: bytes | None, align: int) -> None:
    """The writer's id follows the key (and MAC) inside the padding: the payload offset covers
    it, and a reader that knows nothing of it still reads the object."""
    data = b"kv" * 100
    key = mac_key(secret) if secret else None
    tagged, payload = encode(KEY, NS, data, align=align, secret_key=key, writer=b"W" * 8)
    untagged, _ = encode(KEY, NS, data, align=align, secret_key=key)
    h = decode_header(tagged, KEY, NS)
    assert h.writer == b"W" * 8 and decode_header(untagged, KEY, NS).writer is None
    assert h.payload_offset == len(tagged) and h.payload_offset % align == 0
    verify_payload(h, payload, key)
    if align == 1:
        assert len(tagged) == len(untagged) + 16
    with pytest.raises(ValueError, match="writer must be 8 bytes"):
        encode(KEY, NS, data, writer=b"short")


def test_a_header_cut_before_the_writer_tag_has_no_writer() -> None:
    header, _ = encode(KEY, NS, b"abc", writer=b"W" * 8)
    assert decode_header(header[: HEADER_MIN + len(KEY)], KEY, NS).writer is None


def test_only_provable_damage_is_removable() -> None:
    """A reader may delete what is damaged whoever wrote it; what it merely cannot read
    (another secret, namespace, format version or codec) may be a neighbour's."""
    assert set(REASONS) == REMOVABLE | {"auth", "namespace", "version", "codec"}
    assert not REMOVABLE & {"auth", "namespace", "version", "codec"}


@pytest.mark.parametrize("codec", ["raw", "zstd"])
@pytest.mark.parametrize("encrypt", [False, True])
def test_gcm_seals(codec: str, encrypt: bool) -> None:
    """A GCM seal (GMAC, or AES-256-GCM encrypting the payload): the writer's keys open it, the
    keys of another secret or another namespace do not, a reader without a secret reads a
    GMAC'd payload and refuses an encrypted one; no two objects of a writer share a nonce."""
    from tiering.tier.sealing import KeySchedule

    secret = b"a deployment secret"
    keys = KeySchedule(secret, NS)
    data = b"kv cache " * 2000
    header, payload = encode(KEY, NS, data, codec=codec, keys=keys, encrypt=encrypt)
    h = decode_header(header, KEY, NS)
    assert h.scheme == ("aes-gcm" if encrypt else "gmac") and h.encrypted == encrypt
    assert (data[:64] in bytes(payload)) == (not encrypt and codec == "raw")
    plain = verify_payload(h, payload, mac_key(secret), KeySchedule(secret, NS))
    from tiering.tier.format import decompress

    assert decompress(h.codec, plain, h.raw_length) == data
    for other in (KeySchedule(b"another secret entirely", NS), KeySchedule(secret, bytes(16))):
        with pytest.raises(CorruptObject, match="auth"):
            verify_payload(h, payload, mac_key(secret), other)
    if encrypt:
        with pytest.raises(CorruptObject, match="auth"):
            verify_payload(h, payload)
    else:
        assert verify_payload(h, payload) == payload
    second, _ = encode(KEY, NS, data, codec=codec, keys=keys, encrypt=encrypt)
    assert decode_header(second, KEY, NS).mac[16:28] != h.mac[16:28]  # type: ignore[index]


def test_a_reserved_seal_scheme_is_a_newer_formats() -> None:
    import xxhash

    for bits in (0x20, 0x40, 0x60, 0xE0):  # scheme bits without the sealed bit; an unknown one
        header = bytearray(encode(KEY, NS, b"abcdef")[0])
        header[11] |= bits
        header[58:66] = xxhash.xxh3_64_intdigest(bytes(header[:58]) + KEY).to_bytes(8, "little")
        with pytest.raises(CorruptObject, match="seal scheme"):
            decode_header(bytes(header), KEY, NS)
