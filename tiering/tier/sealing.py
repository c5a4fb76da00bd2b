"""The key schedule of authenticated objects (any thread): AES-256-GCM keys derived from a
deployment's secret, and the nonce rule that never repeats one under a key.

    secret ──HKDF-SHA256(info = domain ‖ store namespace)──▶ namespace key     (one per tier)
    namespace key ──HKDF-Expand(info = domain ‖ salt)──▶ object key             (one per writer)
    object key, nonce = a 96-bit counter ──AES-256-GCM──▶ tag (and ciphertext with `encrypt`)

A writer (one tier instance) draws a random 16-byte salt when it is built and numbers its
objects 0, 1, 2, ... as their nonces; every object carries its salt and nonce, so a reader
derives the same object key (kept for the last salts it met). A nonce therefore repeats under
an object key only if two writers draw the same 128-bit salt (for a fleet that builds 2**32
writers over a secret's life, a chance of 2**-65) and never within one writer: its counter is
taken under a lock and a writer draws a new salt after `OBJECTS_PER_KEY` objects, far inside
GCM's limits for one key. Keys differ per store namespace, so an object moved under another
namespace or written under another secret does not verify.

Nothing here is hand-written cryptography: HKDF and AES-GCM are the `cryptography` package's
(OpenSSL), which releases the GIL while it works.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF, HKDFExpand

from tiering.errors import CorruptObject

__all__ = [
    "NONCE_BYTES",
    "OBJECTS_PER_KEY",
    "SALT_BYTES",
    "TAG_BYTES",
    "KeySchedule",
]

SALT_BYTES: Final = 16
NONCE_BYTES: Final = 12
TAG_BYTES: Final = 16
OBJECTS_PER_KEY: Final = 1 << 32
"""Objects one writer seals under one object key before it draws a new salt."""
_CACHED_KEYS: Final = 256
"""Object keys (one per writer salt met) a reader keeps derived, the oldest derived dropped
first."""
_NAMESPACE_DOMAIN: Final = b"kvtier object keys v2\x00"
_WRITER_DOMAIN: Final = b"kvtier writer key v2\x00"


class KeySchedule:
    """The object keys of one store namespace under one secret (any thread: the counter and
    the cache are under a lock). `seal` and `open` authenticate, and with `encrypt` encrypt,
    one object's payload."""

    def __init__(self, secret: bytes, namespace: bytes) -> None:
        self._root = HKDF(
            algorithm=hashes.SHA256(), length=32, salt=None, info=_NAMESPACE_DOMAIN + namespace
        ).derive(secret)
        self._lock = threading.Lock()
        self._keys: dict[bytes, bytes] = {}
        self._salt = b""
        self._key = b""
        self._next = OBJECTS_PER_KEY  # draws a salt at the first seal

    def key_of(self, salt: bytes) -> bytes:
        """The object key of the writer that drew `salt` (a dict read without the lock: the
        cache only grows under it, dropping its oldest entry)."""
        key = self._keys.get(salt)
        if key is not None:
            return key
        key = HKDFExpand(algorithm=hashes.SHA256(), length=32, info=_WRITER_DOMAIN + salt).derive(
            self._root
        )
        with self._lock:
            self._keys[salt] = key
            if len(self._keys) > _CACHED_KEYS:
                del self._keys[next(iter(self._keys))]
        return key

    def next_nonce(self) -> tuple[bytes, bytes, bytes]:
        """(salt, nonce, object key) for the next object this writer seals: never the same
        (salt, nonce) twice."""
        with self._lock:
            if self._next >= OBJECTS_PER_KEY:
                self._salt = os.urandom(SALT_BYTES)
                self._key = b""
                self._next = 0
            nonce = self._next
            self._next += 1
            salt, key = self._salt, self._key
        if not key:
            key = self.key_of(salt)
            with self._lock:
                if self._salt == salt:
                    self._key = key
        return salt, nonce.to_bytes(NONCE_BYTES, "little"), key

    @staticmethod
    def cipher(key: bytes, nonce: bytes, tag: bytes | None = None) -> Cipher[modes.GCM]:
        return Cipher(algorithms.AES256(key), modes.GCM(nonce, tag))

    def seal(
        self,
        signed: bytes,
        payload: bytes | memoryview,
        encrypt: bool,
        key: bytes,
        nonce: bytes,
        into: memoryview | None = None,
    ) -> tuple[bytes | memoryview, bytes]:
        """(stored payload, tag) of `payload`: the tag covers `signed` and the payload (the
        ciphertext with `encrypt`, written into `into` when given, exactly the payload's size
        and not overlapping it; else the payload as it is, returned as given)."""
        if encrypt and into is None:  # one call, one buffer: the ciphertext and the tag after it
            sealed = AESGCM(key).encrypt(nonce, payload, signed)
            return memoryview(sealed)[:-TAG_BYTES], sealed[-TAG_BYTES:]
        sealer = self.cipher(key, nonce).encryptor()
        sealer.authenticate_additional_data(signed)
        if encrypt and into is not None:
            if payload:
                sealer.update_into(payload, into)
            sealer.finalize()
            return into, sealer.tag
        if payload:
            sealer.authenticate_additional_data(payload)
        sealer.finalize()
        return payload, sealer.tag

    def open(
        self,
        signed: bytes,
        payload: bytes | memoryview,
        encrypted: bool,
        salt: bytes,
        nonce: bytes,
        tag: bytes,
        into: memoryview | None = None,
        in_place: bool = False,
    ) -> bytes | memoryview:
        """The payload of a sealed object (decrypted into `into` when given and encrypted:
        `into` must not overlap `payload`; with `in_place`, into `payload` itself, a writable
        buffer), or `CorruptObject("auth")` if the tag does not verify: another secret's
        object, another namespace's, or altered (an encrypted payload decrypted in place is
        then put back as it was read). A caller uses what it decrypted only once this
        returned."""
        key = self.key_of(salt)
        opener = self.cipher(key, nonce, tag).decryptor()
        opener.authenticate_additional_data(signed)
        out: bytes | memoryview
        where = memoryview(payload)
        if encrypted and in_place:
            out = where
            _crypt_in_place(opener, where)
        elif encrypted:
            if into is None:
                out = memoryview(bytearray(len(payload)))
            else:
                out = into
            if payload:
                opener.update_into(payload, out)
        else:
            if payload:
                opener.authenticate_additional_data(payload)
            out = payload
        try:
            opener.finalize()
        except InvalidTag as e:
            if encrypted and in_place:  # the same key stream again: the ciphertext as read
                _crypt_in_place(self.cipher(key, nonce).encryptor(), where)
            raise CorruptObject("auth", "tag mismatch (another secret, or altered)") from e
        return out


IN_PLACE_CHUNK: Final = 256 << 10
"""The piece of a payload decrypted at a time through a buffer of the thread's (OpenSSL's GCM
will not write over its input through `cryptography`): small enough to stay in the core's
cache, large enough that the calls' overhead stays below 1 % of the pass."""
_bounce = threading.local()


def _crypt_in_place(context: Any, view: memoryview) -> None:
    """Run `view` through a GCM context (its key stream XORed in), piece by piece through the
    calling thread's bounce buffer, leaving the result in `view`."""
    bounce = getattr(_bounce, "buffer", None)
    if bounce is None:
        bounce = _bounce.buffer = memoryview(bytearray(IN_PLACE_CHUNK))
    for start in range(0, len(view), IN_PLACE_CHUNK):
        piece = view[start : start + IN_PLACE_CHUNK]
        out = bounce[: len(piece)]
        context.update_into(piece, out)
        piece[:] = out
