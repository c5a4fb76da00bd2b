"""The self-describing object every secondary tier stores (its codecs and checksums:
`tiering.tier.codecs`, re-exported here).

    offset  size  field
    0       8     magic b"KVTIEROB"
    8       2     format version (`tiering.keys.FORMAT_VERSION`)
    10      1     codec: 0 raw, 1 lz4, 2 zstd
    11      1     checksum: 0 xxh3-64, 1 crc32c; bit 0x80 set: the object is authenticated, by
                  the scheme of bits 0x60: 0x00 HMAC-SHA256 (read, no longer written), 0x20
                  AES-256-GCM over a plaintext payload (GMAC), 0x40 AES-256-GCM encrypting it
    12      2     key length k
    14      4     payload offset (>= 66 + k + the seal; file tiers pad to 4 KiB for O_DIRECT)
    18      16    namespace digest
    34      8     stored payload length (after compression)
    42      8     raw payload length (before compression)
    50      8     payload checksum (of the stored payload: the ciphertext when encrypted)
    58      8     header checksum (xxh3-64 of bytes 0..57 and the key)
    66      k     key
    66+k    44    the seal, with AES-256-GCM (`tiering.tier.sealing`): the writer's 16-byte salt,
                  the 12-byte nonce, the 16-byte tag; it authenticates bytes 0..49, the key, the
                  salt and the nonce as associated data, and the payload (as associated data,
                  or as the plaintext it encrypts)
    66+k    32    the seal, with HMAC-SHA256: the MAC of bytes 0..65+k and the payload
    h       16    optional writer tag: b"KVWR", 4 zero bytes, the writer's 8-byte id (h: the
                  header's end, after the key and seal; in the padding, so readers that do not
                  know it skip it, and not authenticated: it feeds a metric, never a decision)
    ...           zero padding up to the payload offset
            n     payload

All integers little-endian. Reading verifies everything and trusts nothing a header claims until
it is checked, in this order, so that no claim makes a reader allocate or copy what it should not:

1. the header alone (`decode_header`): magic, version, header checksum, namespace, key, codec and
   checksum kind, and lengths that no writer produces: a payload offset before the end of the
   header or past `MAX_PAYLOAD_OFFSET`, a raw length over `MAX_BLOCK_BYTES`, a stored length
   larger than the raw length (`encode` stores a block raw when compressing would not shrink
   it), and for raw payloads a stored length other than the raw length;
2. the object's real size (`check_object`): exactly payload offset + stored length, and the raw
   length the caller expects (the size of the buffer it reads into); readers learn the size
   from the store (a file's length, a Redis value's length) and never read more than the
   largest object their block size allows (`Tier.object_limit`);
3. the payload (`verify_payload`): its checksum, and its seal when the reader has a secret
   (which decrypts an encrypted payload: nothing of it is used before its tag verified);
4. the decoded payload (`decompress`): decompressed with its output bounded by the raw length,
   and exactly that long.

Any mismatch raises `CorruptObject` with a short `reason` (one of `REASONS`); tiers turn that into a
miss and count it by reason. Only damage a reader can prove (`REMOVABLE`: a bad checksum, a torn
object, lengths no writer produces, a name holding something that is no kvtier object or another
key's) lets a writable tier delete the object. An object the reader cannot authenticate, of
another namespace, of a format version or codec it does not know, may be a neighbour's (another
secret, another model, a newer kvtier in a rolling upgrade): it is left where it is.

A checksum is not authentication: anyone who can write to a shared Redis or bucket can plant an
object with valid checksums. With a per-deployment secret, every object is sealed with
AES-256-GCM under a key derived from the secret and the store namespace (`tiering.tier.sealing`),
its payload encrypted too with `auth.encrypt`, and a reader with the secret refuses an object
without a valid seal (`auth`). A reader without a secret ignores a seal over a plaintext payload
and cannot read an encrypted one (`auth`).

The checksum byte's bits 0x60 with bit 0x80 clear are reserved (`codec`: a newer format's).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass
from typing import Final

import xxhash

from tiering.errors import CorruptObject
from tiering.keys import FORMAT_VERSION, NAMESPACE_BYTES, BlockKey
from tiering.tier.codecs import CHECKSUMS, CODECS, Checksum, checksum, compress, decompress
from tiering.tier.scratch import ScratchPool
from tiering.tier.sealing import NONCE_BYTES, SALT_BYTES, TAG_BYTES, KeySchedule

__all__ = [
    "CHECKSUMS",
    "CODECS",
    "FIXED_FIELDS",
    "Checksum",
    "HEADER_MIN",
    "MAC_BYTES",
    "MAGIC",
    "MAX_BLOCK_BYTES",
    "MAX_PAYLOAD_OFFSET",
    "REASONS",
    "REMOVABLE",
    "SCHEMES",
    "SEAL_BYTES",
    "WRITER_BYTES",
    "Header",
    "check_object",
    "checksum",
    "compress",
    "decode_header",
    "decompress",
    "encode",
    "mac_key",
    "peek_key",
    "peek_lengths",
    "verify_payload",
]

MAGIC: Final = b"KVTIEROB"
FIXED_FIELDS: Final = struct.Struct("<8sHBBHI16sQQQQ")
"""The header's fixed fields (the table above), before the key."""
HEADER_MIN: Final = FIXED_FIELDS.size  # 66
MAC_BYTES: Final = 32
"""The seal's length with HMAC-SHA256."""
SEAL_BYTES: Final = SALT_BYTES + NONCE_BYTES + TAG_BYTES
"""The seal's length with AES-256-GCM: salt, nonce, tag."""
_AUTHENTICATED: Final = 0x80
_SCHEME_BITS: Final = 0x60
SCHEMES: Final = {0x00: "hmac-sha256", 0x20: "gmac", 0x40: "aes-gcm"}
"""The seal schemes by their bits in the checksum byte (with bit 0x80)."""
_SCHEME_OF: Final = {name: bits for bits, name in SCHEMES.items()}
_SEAL_LENGTH: Final = {"hmac-sha256": MAC_BYTES, "gmac": SEAL_BYTES, "aes-gcm": SEAL_BYTES}
_SIGNED_FIELDS: Final = 50
"""The fixed fields a GCM seal authenticates: everything before the checksums (the payload
checksum is of the ciphertext, computed after it; both checksums only find damage)."""
MAX_BLOCK_BYTES: Final = 1 << 30
"""The largest block an object may claim. A block is one vLLM offload chunk of every layer: a
256-token block of a 405B-parameter model is ~130 MB, so this is far above any real one and
bounds what a crafted header can make an operator's tool read."""
MAX_PAYLOAD_OFFSET: Final = 1 << 16
"""Writers pad the header to their alignment (4 KiB for O_DIRECT); nothing pads further."""

REASONS: Final = (
    "magic",
    "version",
    "header",
    "namespace",
    "key",
    "codec",
    "length",
    "truncated",
    "checksum",
    "auth",
)
"""Why an object was refused (`CorruptObject.reason`), for metrics."""
REMOVABLE: Final = frozenset(("magic", "header", "key", "length", "truncated", "checksum"))
"""The reasons that prove an object damaged whoever wrote it: a writable tier may delete it.
The others (`auth`, `namespace`, `version`, `codec`) say only that this reader cannot use it:
another secret, another namespace or a newer format's object is a neighbour's, left in place."""
WRITER_BYTES: Final = 8
"""The length of a writer's id in the writer tag."""
_WRITER_TAG: Final = b"KVWR\x00\x00\x00\x00"

_MAC_DOMAIN: Final = b"kvtier object MAC v1\x00"


@dataclass(frozen=True, slots=True)
class Header:
    """A stored object's header, checked by `decode_header` (any thread: a value)."""

    key: BlockKey
    namespace: bytes
    codec: str
    checksum_kind: str
    payload_offset: int
    stored_length: int
    raw_length: int
    payload_checksum: int
    mac: bytes | None = None
    """The object's seal (a GCM seal: salt, nonce, tag; else an HMAC), when it carries one."""
    scheme: str | None = None
    """The seal's scheme (`SCHEMES`), None without one."""
    writer: bytes | None = None
    """The id of the tier that wrote the object (`Tier.writer`), when its header carries a
    writer tag and the bytes read reach it; unauthenticated (a metric's input only)."""
    signed: bytes = b""
    """The header bytes the seal covers (`SCHEMES`: the fixed fields and the key for an HMAC;
    with GCM the fields before the checksums, the key, the salt and the nonce)."""

    @property
    def object_length(self) -> int:
        return self.payload_offset + self.stored_length

    @property
    def encrypted(self) -> bool:
        return self.scheme == "aes-gcm"


def mac_key(secret: bytes) -> bytes:
    """The key objects are authenticated with, derived from a deployment's secret."""
    return hashlib.sha256(_MAC_DOMAIN + secret).digest()


def _mac(key: bytes, signed: bytes, payload: bytes | memoryview) -> bytes:
    mac = hmac.new(key, signed, hashlib.sha256)
    mac.update(payload)
    return mac.digest()


def encode(
    key: BlockKey,
    namespace: bytes,
    data: bytes | memoryview,
    *,
    codec: str = "raw",
    checksum_kind: str = "xxh3",
    align: int = 1,
    secret_key: bytes | None = None,
    keys: KeySchedule | None = None,
    encrypt: bool = False,
    writer: bytes | None = None,
    scratch: ScratchPool | None = None,
) -> tuple[bytes, bytes | memoryview]:
    """The header (padded so the payload starts at a multiple of `align`) and the payload.

    The two parts are returned apart so a tier can write them without joining them (a file
    tier's `pwritev`); `b"".join(parts)` is the object. With codec `raw` and no encryption the
    payload is `data` itself, not a copy. A block that `codec` does not shrink is stored raw
    (the header says so), so a stored payload is never longer than its block. `keys` (the
    deployment secret's `KeySchedule` of `namespace`) seals the object with AES-256-GCM, and
    with `encrypt` encrypts its payload; `secret_key` (`mac_key` of a secret) seals it with an
    HMAC-SHA256 instead (what readers still accept; kept for tests of it); `writer`
    (`WRITER_BYTES` bytes) adds a writer tag. An encrypted payload is written into a buffer
    of `scratch` when given (`tiering.tier.scratch`: the caller gives it back once the object
    is written), else into a new one.
    """
    if len(namespace) != NAMESPACE_BYTES:
        raise ValueError(f"namespace must be {NAMESPACE_BYTES} bytes, got {len(namespace)}")
    payload = compress(codec, data)
    if codec != "raw" and len(payload) >= len(data):
        codec, payload = "raw", data
    scheme = None
    if keys is not None:
        scheme = "aes-gcm" if encrypt else "gmac"
    elif secret_key is not None:
        scheme = "hmac-sha256"
    if checksum_kind not in CHECKSUMS:
        checksum(checksum_kind, b"")  # raises the error that names it
    kind = CHECKSUMS.index(checksum_kind)
    if scheme is not None:
        kind |= _AUTHENTICATED | _SCHEME_OF[scheme]
    if writer is not None and len(writer) != WRITER_BYTES:
        raise ValueError(f"writer must be {WRITER_BYTES} bytes, got {len(writer)}")
    offset = HEADER_MIN + len(key) + (_SEAL_LENGTH[scheme] if scheme is not None else 0)
    if writer is not None:
        offset += len(_WRITER_TAG) + WRITER_BYTES
    offset = -(-offset // align) * align

    def fields(payload_sum: int) -> bytes:
        return FIXED_FIELDS.pack(
            MAGIC,
            FORMAT_VERSION,
            CODECS.index(codec),
            kind,
            len(key),
            offset,
            namespace,
            len(payload),
            len(data),
            payload_sum,
            0,
        )

    seal = b""
    if keys is not None:
        salt, nonce, object_key = keys.next_nonce()
        signed = fields(0)[:_SIGNED_FIELDS] + key + salt + nonce
        into = None
        if encrypt and scratch is not None and len(payload):
            into = memoryview(scratch.take(len(payload)))
        payload, tag = keys.seal(signed, payload, encrypt, object_key, nonce, into)
        seal = salt + nonce + tag
    packed = fields(checksum(checksum_kind, payload))
    header_sum = xxhash.xxh3_64_intdigest(packed[:58] + key)
    header = packed[:58] + header_sum.to_bytes(8, "little") + key
    if secret_key is not None and keys is None:
        seal = _mac(secret_key, header, payload)
    header += seal
    if writer is not None:
        header += _WRITER_TAG + writer
    return header + bytes(offset - len(header)), payload


def decode_header(raw: bytes | memoryview, expect_key: BlockKey, expect_namespace: bytes) -> Header:
    """Parse and check a header (from the start of an object; at least its payload offset's
    worth of bytes, or `HEADER_MIN` + key + MAC). Raises `CorruptObject` on any mismatch, and on
    lengths no writer produces (module docstring, step 1)."""
    raw = memoryview(raw)
    if len(raw) < HEADER_MIN:
        raise CorruptObject("truncated", f"{len(raw)} bytes is shorter than a header")
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
    ) = FIXED_FIELDS.unpack_from(raw)
    if magic != MAGIC:
        raise CorruptObject("magic", "not a kvtier object")
    if version != FORMAT_VERSION:
        raise CorruptObject(
            "version", f"format version {version}, this kvtier reads {FORMAT_VERSION}"
        )
    if len(raw) < HEADER_MIN + key_len:
        raise CorruptObject("truncated", "the header's key is cut short")
    key = bytes(raw[HEADER_MIN : HEADER_MIN + key_len])
    if xxhash.xxh3_64_intdigest(bytes(raw[:58]) + key) != header_sum:
        raise CorruptObject("header", "header checksum mismatch")
    if namespace != expect_namespace:
        raise CorruptObject(
            "namespace", f"namespace {namespace.hex()}, expected {expect_namespace.hex()}"
        )
    if key != expect_key:
        raise CorruptObject("key", f"object holds key {key.hex()}")
    scheme = SCHEMES.get(kind & _SCHEME_BITS) if kind & _AUTHENTICATED else None
    if kind & _SCHEME_BITS and scheme in (None, "hmac-sha256"):
        raise CorruptObject("codec", f"unknown seal scheme {kind & 0xE0:#x}")
    kind &= ~(_AUTHENTICATED | _SCHEME_BITS)
    if codec >= len(CODECS) or kind >= len(CHECKSUMS):
        raise CorruptObject("codec", f"unknown codec {codec} or checksum {kind}")
    seal_end = HEADER_MIN + key_len + (_SEAL_LENGTH[scheme] if scheme is not None else 0)
    if not seal_end <= offset <= MAX_PAYLOAD_OFFSET:
        raise CorruptObject("length", f"payload offset {offset} (the header ends at {seal_end})")
    if raw_len > MAX_BLOCK_BYTES:
        raise CorruptObject("length", f"a block of {raw_len} bytes (at most {MAX_BLOCK_BYTES})")
    if stored > raw_len or (CODECS[codec] == "raw" and stored != raw_len):
        raise CorruptObject(
            "length", f"stored payload of {stored} bytes for a {CODECS[codec]} block of {raw_len}"
        )
    signed = bytes(raw[:HEADER_MIN]) + key
    mac = None
    if scheme is not None:
        if len(raw) < seal_end:
            raise CorruptObject("truncated", "the header's seal is cut short")
        mac = bytes(raw[HEADER_MIN + key_len : seal_end])
        if scheme != "hmac-sha256":
            signed = bytes(raw[:_SIGNED_FIELDS]) + key + mac[: SALT_BYTES + NONCE_BYTES]
    return Header(
        BlockKey(key),
        namespace,
        CODECS[codec],
        CHECKSUMS[kind],
        offset,
        stored,
        raw_len,
        payload_sum,
        mac,
        scheme,
        _writer(raw, seal_end, offset),
        signed,
    )


def _writer(raw: memoryview, header_end: int, offset: int) -> bytes | None:
    """The writer tag's id, when the padding after the header starts with one (`encode`)."""
    end = header_end + len(_WRITER_TAG) + WRITER_BYTES
    if end > offset or end > len(raw) or bytes(raw[header_end : end - WRITER_BYTES]) != _WRITER_TAG:
        return None
    return bytes(raw[end - WRITER_BYTES : end])


def check_object(header: Header, size: int, expect_raw: int | None = None) -> None:
    """Check a header's claims against the object's real size (`size` bytes) and, given, the
    size of the block the caller expects."""
    if size < header.object_length:
        raise CorruptObject(
            "truncated", f"object of {size} bytes, its header says {header.object_length}"
        )
    if size > header.object_length:
        raise CorruptObject(
            "length", f"object of {size} bytes, its header says {header.object_length}"
        )
    if expect_raw is not None and header.raw_length != expect_raw:
        raise CorruptObject(
            "length", f"block of {header.raw_length} bytes, the buffer holds {expect_raw}"
        )


def peek_lengths(raw: bytes | memoryview) -> tuple[int, int] | None:
    """(payload offset, stored payload length) of a header, unverified; None if it is not one.
    For backends that read the header first to place the payload; `decode_header` verifies."""
    if len(raw) < HEADER_MIN or bytes(raw[:8]) != MAGIC:
        return None
    fields = FIXED_FIELDS.unpack_from(raw)
    return int(fields[5]), int(fields[7])


def peek_key(raw: bytes | memoryview) -> BlockKey | None:
    """The key a header names, unverified; None if `raw` does not start with one. For backends
    that find objects without knowing their keys (a scan); `decode_header` verifies."""
    if len(raw) < HEADER_MIN or bytes(raw[:8]) != MAGIC:
        return None
    key_len = int(FIXED_FIELDS.unpack_from(raw)[4])
    if len(raw) < HEADER_MIN + key_len:
        return None
    return BlockKey(bytes(raw[HEADER_MIN : HEADER_MIN + key_len]))


def verify_payload(
    header: Header,
    payload: bytes | memoryview,
    secret_key: bytes | None = None,
    keys: KeySchedule | None = None,
    into: memoryview | None = None,
    in_place: bool = False,
) -> bytes | memoryview:
    """The stored payload of `header` as it was sealed (decrypted when it was encrypted),
    once its length and checksum match its header and, for a reader with a secret (`keys`, its
    `KeySchedule`, and `secret_key`, `mac_key` of it, for HMAC seals), its seal verifies.
    An encrypted payload is decrypted into `into` when given (not overlapping `payload`), or
    with `in_place` into `payload` itself (a writable buffer; as read again when refused).
    Raises `CorruptObject`; a reader without a secret ignores a seal over a plaintext payload
    and refuses an encrypted one (`auth`: it cannot read it).

    A sealed payload is checked by its seal alone (a strictly stronger check, one pass less);
    the checksum is computed only when the seal fails, to tell damage anyone can prove
    (`checksum`, removable) from an object this reader cannot authenticate (`auth`)."""
    if len(payload) != header.stored_length:
        raise CorruptObject(
            "truncated", f"payload of {len(payload)} bytes, header says {header.stored_length}"
        )
    sealed = header.mac is not None and (
        keys is not None if header.scheme != "hmac-sha256" else secret_key is not None
    )
    if not sealed and checksum(header.checksum_kind, payload) != header.payload_checksum:
        raise CorruptObject("checksum", "payload checksum mismatch")
    if keys is None and secret_key is None:
        if header.encrypted:
            raise CorruptObject("auth", "the payload is encrypted and this reader has no secret")
        return payload
    try:
        return _unseal(header, payload, secret_key, keys, into, in_place)
    except CorruptObject:
        if sealed and checksum(header.checksum_kind, payload) != header.payload_checksum:
            raise CorruptObject("checksum", "payload checksum mismatch") from None
        raise


def _unseal(
    header: Header,
    payload: bytes | memoryview,
    secret_key: bytes | None,
    keys: KeySchedule | None,
    into: memoryview | None,
    in_place: bool,
) -> bytes | memoryview:
    if header.mac is None:
        raise CorruptObject("auth", "the object carries no seal (written without the secret)")
    if header.scheme == "hmac-sha256":
        if secret_key is None or not hmac.compare_digest(
            _mac(secret_key, header.signed, payload), header.mac
        ):
            raise CorruptObject("auth", "MAC mismatch (another secret, or altered)")
        return payload
    if keys is None:
        raise CorruptObject("auth", "a GCM seal and no secret to open it with")
    salt, nonce, tag = (
        header.mac[:SALT_BYTES],
        header.mac[SALT_BYTES : SALT_BYTES + NONCE_BYTES],
        header.mac[SALT_BYTES + NONCE_BYTES :],
    )
    return keys.open(header.signed, payload, header.encrypted, salt, nonce, tag, into, in_place)
