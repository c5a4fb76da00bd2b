"""A request that a running engine write its manifest of use now: a value (any thread), written
by an operator's command (`kvtier manifest --write-now`, its `asyncio.run`) and answered by the
engine's recorder (`tiering.manager.recorder`, the runtime's loop).

The channel is the store the engine reads already, not a signal: vLLM and Python own the
engine's signal handlers, and under vLLM's multiprocess mode the scheduler's process is not the
one an operator signals. The command writes record `manifest-request.<engine id>` (`Tier.
write_record`) to the tiers that keep records; the tier's envelope seals it like a block (its
namespace, checksum and, with `auth.secret`, its seal), so under a secret only holders of the
secret can ask: anything else in its place is refused, removed and counted, never answered. The
recorder looks for it every `primary.manifest_requests` seconds (`POLL` by default; 0: never) in
each tier it writes manifests to (a files
directory: one `open` that fails while none is there, no disk I/O once the directory is cached;
Redis: one GETRANGE; S3: one GET, answered 404), writes its manifest at once, off the scheduler's
thread, and removes the request. A flood of requests cannot make it write more often than
every `FLOOR` seconds, nor take more than 1/`DUTY` of the runtime's thread (the recorder's own
bound): a request met sooner waits in the store for the next look past that.

Body, integers big-endian: `MAGIC` (8 bytes), version (u16), engine id (u8 length + ASCII), host
(u8 length + UTF-8), pid (u32), nonce (8), asked at (f64, Unix seconds, the asker's clock), then
the first 16 bytes of SHA-256 over all of it. At most `MAX_REQUEST_BYTES` is read back: a larger
object planted there costs a stat.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Final

from tiering.manager.manifest import ManifestRefused

__all__ = [
    "FLOOR",
    "MAX_REQUEST_BYTES",
    "POLL",
    "ManifestRequest",
    "decode_request",
    "encode_request",
    "request_name",
]

MAGIC: Final = b"KVTASK\x00\x00"
VERSION: Final = 1
POLL: Final = 2.0
"""Seconds between two looks for a request (per tier: a failed open, a GETRANGE, an S3 GET)."""
FLOOR: Final = 5.0
"""The fewest seconds between two manifest writes that requests cause: at most 12 a minute, a
1.9 MB manifest of a 100 GiB primary at most 0.4 MB/s per tier, whoever asks how often."""
MAX_REQUEST_BYTES: Final = 4096
_FIXED = struct.Struct(">IQd")  # pid, nonce, asked at
_DIGEST = 16


@dataclass(frozen=True, slots=True)
class ManifestRequest:
    """An operator's request that engine `engine` write its manifest now (a value)."""

    engine: str
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    nonce: int = field(default_factory=lambda: secrets.randbits(63))
    asked_at: float = field(default_factory=time.time)

    def asker(self) -> str:
        return f"host {self.host!r} pid {self.pid}"


def request_name(engine: str) -> str:
    """The record a request to `engine` is stored as."""
    return f"manifest-request.{engine}"


def _short(text: str) -> bytes:
    raw = text.encode()[:255]
    return bytes([len(raw)]) + raw


def encode_request(request: ManifestRequest) -> bytes:
    body = b"".join(
        [
            MAGIC,
            VERSION.to_bytes(2, "big"),
            _short(request.engine),
            _short(request.host),
            _FIXED.pack(request.pid, request.nonce, request.asked_at),
        ]
    )
    return body + hashlib.sha256(body).digest()[:_DIGEST]


def decode_request(data: bytes, engine: str) -> ManifestRequest:
    """The request `data` holds when it is whole and to `engine`; else `ManifestRefused`."""
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if len(data) < len(MAGIC) + 2 + _DIGEST or not data.startswith(MAGIC):
        raise ManifestRefused("magic", "not a kvtier manifest request")
    if hashlib.sha256(body).digest()[:_DIGEST] != digest:
        raise ManifestRefused("corrupt", "its digest does not match")
    version = int.from_bytes(body[len(MAGIC) : len(MAGIC) + 2], "big")
    if version != VERSION:
        raise ManifestRefused("version", f"request format {version}, this kvtier reads {VERSION}")
    at = len(MAGIC) + 2
    fields: list[str] = []
    for _ in range(2):
        n = body[at] if at < len(body) else 0
        fields.append(body[at + 1 : at + 1 + n].decode("utf-8", "replace"))
        at += 1 + n
    if len(body) - at != _FIXED.size:
        raise ManifestRefused("truncated", f"{len(body) - at} bytes after its names")
    writer, host = fields
    if writer != engine:
        raise ManifestRefused("engine", f"to engine {writer!r}, not {engine!r}")
    pid, nonce, asked_at = _FIXED.unpack(body[at:])
    return ManifestRequest(writer, host, pid, nonce, asked_at)
