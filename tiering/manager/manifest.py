"""The manifest of use: a value (any thread) and its reading from the tiers (the runtime's
loop, or an operator command's `asyncio.run`).

A manifest is the primary's own order of use, hottest first (`PrimaryPool.hottest`: LRU order;
for ARC its frequency list before its recency list), as block keys only, with what binds it to
its writer: the format version, the namespace, the engine's identity (`engine_identity`) and the
writing process (host, pid, a session nonce: what tells two live engines of one identity
apart, `clash`). The recorder (`tiering.manager.recorder`) writes it to every persistent tier
that keeps records (`Tier.write_record`: a `files` directory's `.kvtier/records/`, a Redis key,
an S3 object), as record `manifest.<engine id>`, sealed by the tier's envelope (its namespace,
checksum and, with `auth.secret`, its seal); a restarted engine's warm start reads it back
(`read_manifest`) and follows it. An operator can ask a running engine to write it now
(`tiering.manager.request`) and list every engine's (`Tier.list_records`, `kvtier stats`).

Body, all integers big-endian: `MAGIC` (8 bytes), version (u16), namespace (16), engine id (u8
length + ASCII), host (u8 length + UTF-8), pid (u32), session (8), written at (f64, Unix seconds),
ended (u8: written at the writer's shutdown), the writer's `primary.warm_manifest_interval` (f64
seconds; version 2 on, so that a reader judges a writer live by that writer's own interval:
`is_live`), the writer's last warm start (source u8, planned, read, skipped, remaining: u32 each),
key count (u32), the keys (u8 length + bytes each), then the first 16 bytes of SHA-256 over all
of it. Version 1 (no interval) is still read; a kvtier that reads only version 1 refuses a
version 2 manifest (`version`: its warm start takes the newest-first plan, one log line). A
block of vLLM's sha256 hashes takes 37 bytes (a 100 GiB primary of 2 MiB blocks: 51,200 keys,
1.9 MB), plus about 108 bytes and the envelope's header per manifest.

A manifest that is truncated, damaged, of another version, namespace or engine, or (with a
secret) not sealed by it is refused whole (`ManifestRefused`, one word of reason): nothing is
read from it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from tiering.config.schema import ENGINE_ID
from tiering.errors import ConfigError, CorruptObject, TierError
from tiering.keys import BlockKey
from tiering.tier import Tier
from tiering.tier.rotation import RotatingTier

__all__ = [
    "ENGINE_ID",
    "MAGIC",
    "MANIFEST_VERSION",
    "Manifest",
    "ManifestRefused",
    "WarmProgress",
    "decode",
    "encode",
    "engine_identity",
    "is_live",
    "read_manifest",
    "record_name",
]

log = logging.getLogger(__name__)

MAGIC: Final = b"KVTWARM\x00"
MANIFEST_VERSION: Final = 2
READS: Final = (1, 2)
"""The format versions `decode` reads (1: without the writer's interval)."""
LIVE_INTERVALS: Final = 3
"""A manifest is a live engine's for this many of its writer's intervals after its write: one
late or failed write does not drop a live engine."""
DIGEST_BYTES: Final = 16
SOURCES: Final = ("none", "manifest", "newest")
"""What a warm start followed (`WarmProgress.source`)."""
_FIXED = struct.Struct(">IQdB")  # pid, session, written at, ended
_INTERVAL = struct.Struct(">d")  # the writer's interval (version 2 on)
_PROGRESS = struct.Struct(">BIIII")
_IDENTITY_DOMAIN = b"kvtier engine identity v1\x00"


class ManifestRefused(ValueError):
    """A manifest that may not be followed; `reason` is one word (`truncated`, `corrupt`,
    `version`, `namespace`, `engine`, `auth`, ...)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class WarmProgress:
    """A warm start's figures (any thread: a value): what it followed and how far it got."""

    source: str = "none"
    planned: int = 0
    read: int = 0
    skipped: int = 0
    remaining: int = 0


@dataclass(frozen=True, slots=True)
class Manifest:
    """One engine's order of use (any thread: a value)."""

    namespace: bytes
    engine: str
    keys: Sequence[BlockKey]
    """Hottest first."""
    host: str = field(default_factory=socket.gethostname)
    pid: int = 0
    session: int = 0
    written_at: float = field(default_factory=time.time)
    warm: WarmProgress = WarmProgress()
    """The writer's own warm start, as it stood at the write."""
    ended: bool = False
    """Written at the writer's shutdown: no live engine stands behind it."""
    interval: float | None = None
    """The writer's `primary.warm_manifest_interval` (0: at shutdown only; None: unknown, a
    version 1 manifest)."""


def record_name(engine: str) -> str:
    """The record a manifest of `engine` is stored as."""
    return f"manifest.{engine}"


def check_engine_id(engine: str, named: str = "primary.engine_id") -> str:
    if not isinstance(engine, str) or not ENGINE_ID.match(engine):
        raise ConfigError(f"{named}: {engine!r} is not {ENGINE_ID.pattern[:-2]}")
    return engine


def engine_identity(configured: str | None, namespace: bytes, host: str | None = None) -> str:
    """The engine's identity on its stores: `primary.engine_id` when set, else 16 hex digits
    of SHA-256 over the host's name and the namespace. Stable across restarts on one host
    (what a restarted engine must find), distinct between hosts (what one shared store must
    tell apart); two engines of one model on one host get the same default and are told so at
    start (`clash`): set `primary.engine_id` for each (`${VAR}` reads the environment)."""
    if configured is not None:
        return check_engine_id(configured)
    host = socket.gethostname() if host is None else host
    digest = hashlib.sha256(_IDENTITY_DOMAIN + host.encode() + b"\x00" + namespace).hexdigest()
    return digest[:16]


def _short(text: str) -> bytes:
    raw = text.encode()[:255]
    return bytes([len(raw)]) + raw


def encode(manifest: Manifest) -> bytes:
    """The manifest's body (module docstring)."""
    parts = [MAGIC, MANIFEST_VERSION.to_bytes(2, "big"), manifest.namespace]
    parts += [_short(manifest.engine), _short(manifest.host)]
    parts.append(_FIXED.pack(manifest.pid, manifest.session, manifest.written_at, manifest.ended))
    parts.append(_INTERVAL.pack(manifest.interval or 0.0))
    w = manifest.warm
    parts.append(_PROGRESS.pack(SOURCES.index(w.source), w.planned, w.read, w.skipped, w.remaining))
    parts.append(len(manifest.keys).to_bytes(4, "big"))
    parts += [bytes([len(key)]) + key for key in manifest.keys]
    body = b"".join(parts)
    return body + hashlib.sha256(body).digest()[:DIGEST_BYTES]


class _Reader:
    __slots__ = ("at", "data")

    def __init__(self, data: bytes) -> None:
        self.data, self.at = memoryview(data), 0

    def take(self, n: int) -> bytes:
        if self.at + n > len(self.data):
            raise ManifestRefused("truncated", f"ends at byte {len(self.data)}")
        self.at += n
        return bytes(self.data[self.at - n : self.at])

    def short(self) -> str:
        return self.take(self.take(1)[0]).decode("utf-8", "replace")


def decode(data: bytes, namespace: bytes, engine: str) -> Manifest:
    """The manifest `data` holds, when it is whole and `engine`'s of `namespace`; else
    `ManifestRefused`."""
    if len(data) < len(MAGIC) + 2 + DIGEST_BYTES or not data.startswith(MAGIC):
        raise ManifestRefused("magic", "not a kvtier manifest")
    version = int.from_bytes(data[len(MAGIC) : len(MAGIC) + 2], "big")
    if version not in READS:
        raise ManifestRefused("version", f"format {version}, this kvtier reads {READS}")
    body, digest = data[:-DIGEST_BYTES], data[-DIGEST_BYTES:]
    if hashlib.sha256(body).digest()[:DIGEST_BYTES] != digest:
        raise ManifestRefused("corrupt", "its digest does not match")
    r = _Reader(body)
    r.take(len(MAGIC) + 2)
    ns = r.take(len(namespace))
    if ns != namespace:
        raise ManifestRefused("namespace", f"of namespace {ns.hex()}, not {namespace.hex()}")
    writer = r.short()
    if writer != engine:
        raise ManifestRefused("engine", f"of engine {writer!r}, not {engine!r}")
    host = r.short()
    pid, session, written_at, ended = _FIXED.unpack(r.take(_FIXED.size))
    interval = _INTERVAL.unpack(r.take(_INTERVAL.size))[0] if version >= 2 else None
    if interval is not None and not 0.0 <= interval < float("inf"):
        raise ManifestRefused("corrupt", f"an interval of {interval} s")
    source, planned, read, skipped, remaining = _PROGRESS.unpack(r.take(_PROGRESS.size))
    count = int.from_bytes(r.take(4), "big")
    keys = [BlockKey(r.take(r.take(1)[0])) for _ in range(count)]
    if r.at != len(body):
        raise ManifestRefused("corrupt", f"{len(body) - r.at} bytes after its keys")
    warm = WarmProgress(SOURCES[min(source, len(SOURCES) - 1)], planned, read, skipped, remaining)
    return Manifest(ns, writer, keys, host, pid, session, written_at, warm, bool(ended), interval)


def is_live(found: Manifest, now: float, default: float) -> bool:
    """Whether a live engine stands behind `found`: not written at its writer's shutdown, and
    written within `LIVE_INTERVALS` of its writer's intervals of `now`, either way (writers'
    clocks differ; one written far ahead is no live writer's either); within `default` seconds
    where the interval is unknown (version 1) or 0 (at shutdown only: no periodic write says
    the writer is alive)."""
    if found.ended:
        return False
    span = LIVE_INTERVALS * found.interval if found.interval else default
    return abs(now - found.written_at) <= span


async def read_manifest(
    tiers: Sequence[Tier], namespace: bytes, engine: str
) -> tuple[Manifest | None, str]:
    """The newest usable manifest of `engine` among `tiers` (each asked once, in order; a tier
    during a rotation of its secret, `RotatingTier`, in each previous secret's names too, where
    a manifest names their namespace), and a line saying where it came from or why there is
    none. A refused one is logged (one line
    each) and never followed; a tier that cannot answer is passed over."""
    found: Manifest | None = None
    source = ""
    refusals: list[str] = []
    name = record_name(engine)
    asked: list[tuple[Tier, bytes]] = []
    for tier in tiers:  # during a rotation, each previous secret's names too (their namespace)
        asked.append((tier, namespace))
        if isinstance(tier, RotatingTier):
            asked += [(old, old.namespace) for old in tier.previous]
    for tier, expected in asked:
        try:
            data = await tier.read_record(name)
            if data is None:
                continue
            manifest = decode(data, expected, engine)
        except (CorruptObject, ManifestRefused) as e:
            line = f"tier {tier.name!r}: {e.reason}"
            refusals.append(line)
            log.warning(
                "kvtier: warm start: manifest of engine %s refused (%s: %s)", engine, line, e
            )
            continue
        except TierError as e:
            refusals.append(f"tier {tier.name!r} unreadable")
            log.warning("kvtier: warm start: tier %r: manifest not read: %s", tier.name, e)
            continue
        if found is None or manifest.written_at > found.written_at:
            found, source = manifest, tier.name
    if found is not None:
        age = max(0.0, time.time() - found.written_at)
        return found, f"manifest of engine {engine} from tier {source!r}, {age:.0f} s old"
    why = "; ".join(refusals) if refusals else "none stored"
    return None, f"no usable manifest of engine {engine} ({why})"


def clash(
    found: Manifest, *, interval: float, session: int, now: float | None = None
) -> str | None:
    """Why `found` (read from a store at start, or just before a write) looks written by
    another live engine of the same identity, or None: a session not ours, written within
    two intervals (a writer alive rewrites it every interval: the writer's own where the
    manifest says it, else `interval`, ours; at shutdown-only, within a minute), not at its
    writer's shutdown, by another host or a live process of this host."""
    if found.session == session or found.ended:
        return None
    now = time.time() if now is None else now
    span = found.interval if found.interval is not None else interval
    if now - found.written_at > max(2 * span, 60.0):
        return None
    if found.host == socket.gethostname() and found.pid != os.getpid() and not _alive(found.pid):
        return None  # a process of this host that has ended: this engine's last run
    return f"host {found.host!r} pid {found.pid} wrote it {now - found.written_at:.0f} s ago"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's: alive
    return True
