"""The object envelope: how a tier seals a block into a stored object and opens one it reads
back (any thread: an immutable value, pure functions of its settings).

A tier holds one (`Tier.envelope`): its namespace, codec, checksum kind, payload alignment,
writer id and, with a deployment secret, the key schedule of its namespace
(`tiering.tier.sealing`) and whether payloads are encrypted. Sealing is
`tiering.tier.format.encode` with those settings; opening applies every step of
`tiering.tier.format`'s verification (header, real size, checksum, seal, decryption, bounded
decoding) and raises `CorruptObject` at the first that fails. The tier decides what a refusal
means (a counted miss, a deletion); the envelope only answers whether an object is sound. A
tier seals and opens large sealed blocks on the sealing threads (`sealing_threads`), the rest
on its event loop.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from tiering.errors import ConfigError, CorruptObject
from tiering.keys import BlockKey
from tiering.tier.format import (
    WRITER_BYTES,
    Header,
    check_object,
    decode_header,
    decompress,
    encode,
    mac_key,
    verify_payload,
)
from tiering.tier.scratch import ScratchPool
from tiering.tier.sealing import KeySchedule
from tiering.tier.threads import IOThreads

__all__ = [
    "MIN_SECRET_BYTES",
    "SEAL_IN_THREADS",
    "SEEN_BYTES",
    "SPARE_CORES",
    "Envelope",
    "ciphertext_buffers",
    "seal_threshold",
    "sealing_threads",
]

Buffer = bytes | memoryview

MIN_SECRET_BYTES: Final = 16
"""The shortest deployment secret a tier accepts for authenticated objects."""
SEEN_BYTES: Final = 256
"""The first bytes of a refused object kept with the refusal (`CorruptObject.seen`): the
header, the key, the MAC and the writer tag of any object (at most 66 + 68 + 32 + 16 bytes), so
two objects that differ in anything a header or MAC covers differ in them."""
SEAL_IN_THREADS: Final = 512 << 10
"""From this block size, a tier with a secret on a host with cores to spare (`seal_threshold`)
seals and opens objects on the sealing threads (`sealing_threads`), off the runtime's event
loop: AES-GCM releases the GIL, so the loop goes on with other calls' I/O while another core
seals. Below it the hand-over (~50 us) costs about what the cryptography does (BENCHMARKS.md,
"Sealed objects")."""
SPARE_CORES: Final = 4
"""The cores from which a host seals on threads by default (`seal_threshold`): with two, the
loop's own I/O keeps the other core busy and the hand-over costs more than it frees
(BENCHMARKS.md, "Sealed objects": on the loop 0.78-0.94 where the threads gave 0.48-0.81)."""
SEALING_THREADS: Final = 2


def seal_threshold() -> int:
    """The block size from which tiers seal and open on the sealing threads by default:
    `SEAL_IN_THREADS` on a host with `SPARE_CORES` usable cores or more, never below."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return SEAL_IN_THREADS if cores >= SPARE_CORES else 1 << 62


_scratch = ScratchPool()
"""The process's buffers for ciphertexts (`Envelope.seal`, `Envelope.written`)."""
_sealers: list[IOThreads] = []
_sealers_lock = threading.Lock()


def ciphertext_buffers() -> ScratchPool:
    """The process's pool of buffers encrypted payloads are sealed into."""
    return _scratch


def sealing_threads() -> IOThreads:
    """The process's sealing threads (made at the first call; any thread)."""
    if not _sealers:
        with _sealers_lock:
            if not _sealers:
                _sealers.append(IOThreads(SEALING_THREADS, "kvtier-seal"))
    return _sealers[0]


@dataclass(frozen=True, slots=True, kw_only=True)
class Envelope:
    """One tier's way of sealing and opening objects (any thread: a value). Build it with
    `of`; a wrapper that verifies with another tier's secret takes that tier's `mac`
    (`dataclasses.replace`)."""

    namespace: bytes
    """The namespace digest every object carries and every read expects."""
    codec: str = "raw"
    """How payloads are compressed when written (`tiering.tier.format.CODECS`)."""
    checksum: str = "xxh3"
    """The payload checksum written (`tiering.tier.format.CHECKSUMS`)."""
    align: int = 1
    """Payload offset alignment of written objects."""
    writer: bytes = field(default_factory=lambda: os.urandom(WRITER_BYTES))
    """The id written in every object's writer tag (`Tier.writer`)."""
    mac: bytes | None = field(default=None, repr=False)
    """The key derived from the deployment's secret (`tiering.tier.format.mac_key`) that checks
    HMAC seals and roots the keys of a store's shared records (a ledger, a lease); None: objects
    are written without a seal and read without checking one."""
    keys: KeySchedule | None = field(default=None, repr=False, compare=False)
    """The secret's key schedule of `namespace`: objects are sealed with AES-256-GCM."""
    encrypt: bool = False
    """Whether payloads are encrypted (`auth.encrypt`), not only authenticated."""

    @classmethod
    def of(
        cls,
        namespace: bytes,
        *,
        secret: bytes | None = None,
        encrypt: bool = False,
        codec: str = "raw",
        checksum: str = "xxh3",
        align: int = 1,
    ) -> Envelope:
        """The envelope for `namespace`, with `secret` (at least `MIN_SECRET_BYTES`, else
        `ConfigError`) sealing every object, and encrypting its payload with `encrypt`, and a
        fresh writer id."""
        if secret is None:
            if encrypt:
                raise ConfigError("auth.encrypt: encryption needs auth.secret")
            return cls(namespace=namespace, codec=codec, checksum=checksum, align=align)
        if len(secret) < MIN_SECRET_BYTES:
            raise ConfigError(f"secret: at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
        return cls(
            namespace=namespace,
            codec=codec,
            checksum=checksum,
            align=align,
            mac=mac_key(bytes(secret)),
            keys=KeySchedule(bytes(secret), namespace),
            encrypt=encrypt,
        )

    @property
    def authenticated(self) -> bool:
        """Whether objects are written with, and required to carry, a seal."""
        return self.mac is not None

    def sealed_by(self, other: Envelope) -> Envelope:
        """This envelope with `other`'s secret and encryption (a wrapper verifying with the
        tier it wraps)."""
        return dataclasses.replace(self, mac=other.mac, keys=other.keys, encrypt=other.encrypt)

    def seal(self, key: BlockKey, data: Buffer | bytearray) -> tuple[Buffer, Buffer]:
        """The stored object of block `data` under `key`, as its parts (header, payload: the
        payload is `data` itself with the `raw` codec and no encryption, not a copy; an
        encrypted payload lies in a reused, page-aligned buffer, which `written` takes back
        once the object is written)."""
        return encode(
            key,
            self.namespace,
            memoryview(data),
            codec=self.codec,
            checksum_kind=self.checksum,
            align=self.align,
            keys=self.keys,
            encrypt=self.encrypt,
            writer=self.writer,
            scratch=_scratch,
        )

    @staticmethod
    def written(parts: Sequence[object]) -> None:
        """The object of `parts` (`seal`'s) is written and nothing reads its parts any more:
        its ciphertext's buffer goes back for the next encrypted put. Not called after a
        failed or cancelled write (a thread may still read the buffer: it is left to the
        garbage collector)."""
        _scratch.give_back(parts)

    def header(self, key: BlockKey, head: Buffer) -> Header:
        """The checked header of the object of `key` whose first bytes are `head`."""
        return decode_header(head, key, self.namespace)

    def open(self, key: BlockKey, blob: Buffer, size: int | None = None) -> tuple[Header, Buffer]:
        """The checked header and the block a stored object of `key` holds, verified in every
        step (`size`: the block size expected). Raises `CorruptObject`."""
        blob = memoryview(blob)
        try:
            header = decode_header(blob, key, self.namespace)
            check_object(header, len(blob), size)
            payload = blob[header.payload_offset : header.object_length]
            plain = verify_payload(header, payload, self.mac, self.keys)
            return header, decompress(header.codec, plain, header.raw_length)
        except CorruptObject as e:
            e.seen = bytes(blob[:SEEN_BYTES])
            raise

    def open_into(self, key: BlockKey, blob: Buffer, view: memoryview) -> Header:
        """`open` an object of `key` and put its block in `view` (exactly the block's size):
        an encrypted raw payload is decrypted straight into it. After a `CorruptObject`, `view`
        holds no block."""
        blob = memoryview(blob)
        try:
            header = decode_header(blob, key, self.namespace)
            check_object(header, len(blob), len(view))
            payload = blob[header.payload_offset : header.object_length]
            direct = header.encrypted and header.codec == "raw" and self.keys is not None
            plain = verify_payload(header, payload, self.mac, self.keys, view if direct else None)
            if not direct:
                view[:] = decompress(header.codec, plain, header.raw_length)
            return header
        except CorruptObject as e:
            e.seen = bytes(blob[:SEEN_BYTES])
            raise

    def open_placed(self, key: BlockKey, header_bytes: Buffer, view: memoryview) -> Header:
        """Check a header and the payload a backend read straight into `view` (`ReadsInto`):
        `CorruptObject` unless they are `key`'s, of this namespace, raw, with a matching
        checksum (and seal); the checked header. An encrypted payload is decrypted where it
        lies (put back as read when refused, so its checksum still tells damage)."""
        try:
            header = decode_header(header_bytes, key, self.namespace)
            if header.payload_offset != len(header_bytes):
                raise CorruptObject(
                    "length", "the payload was read from another offset than its own"
                )
            if header.codec != "raw":
                raise CorruptObject("codec", f"expected a raw object, found {header.codec}")
            check_object(header, header.payload_offset + len(view), len(view))
            verify_payload(header, view, self.mac, self.keys, in_place=True)
            return header
        except CorruptObject as e:
            e.seen = bytes(memoryview(header_bytes)[:SEEN_BYTES])
            raise
