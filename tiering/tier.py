"""The secondary-tier contract: five primitives a backend writes, and the base that does the rest.

This module is over 400 lines on purpose: it is one class, `Tier`, and its docstrings are the
specification a backend author works from (each primitive with what the base guarantees and
what the implementation must do, the optional fast paths, the public API the manager and the
operators' commands call). The object format and each step of verifying an object are in
`tiering.format`; what is here is only how a tier applies them.

A backend implements async primitives over *stored objects* (the bytes of `tiering.format`:
header, then payload) and declares what it can do in class attributes; `Tier` adds everything
else: encoding and verification of every object, the public `get(key, into)` / `put(key, data)`
over block payloads, batched forms with bounded concurrency, a deadline on every call, read-only
mode, authenticated objects (`secret`), counters, and the async context manager.

    @dataclass(frozen=True, kw_only=True, slots=True)
    class MyOptions(TierOptions):                  # its own settings, read from YAML alike
        root: str = option(kind="path", help="Where the objects live.")

    class MyTier(Tier):
        type_name = "mine"
        persistent = True
        Options = MyOptions
        async def _read(self, key, limit): ...    # the stored object, or None
        async def _write(self, key, parts): ...   # store b"".join(parts) atomically (False:
                                                  # one was there already, nothing written)
        async def _delete(self, key): ...         # True if it was there
        async def _contains(self, keys): ...      # one bool per key
        async def _stat(self): ...                # TierStat

Optional, with defaults here: `_read_head(key, n)` (a ranged read), `_list()` and `_entries()`
(with `supports_listing = True`), `_namespaces()`, `_close()`, `knows(key)` (with `indexed =
True`: an in-process index of every object). Optional fast paths the base looks for are
`Protocol`s: `ReadsInto` (the payload read straight into the caller's buffer).

What the base class guarantees every primitive: keys are `BlockKey`s already validated (no path
or name comes from input); `limit` is the largest object the caller can use (`object_limit` of
its block size); a write or a delete never reaches a read-only tier; every call runs on the
event loop thread that owns the tier (the runtime's, or an operator command's `asyncio.run`),
under the tier's deadline, so it may be cancelled at any await; nothing a backend returns is
trusted: every object is verified here before a byte of it reaches a caller's block.

What every primitive must do: never read or allocate more than `limit` bytes for one object (a
store holding a larger one answers `CorruptObject("length")` without reading it: a crafted 2 GiB
object costs a stat, not 2 GiB); raise `TierUnavailable`, `TierTimeout`, `TierFull` or
`TierError` (translated from its library's errors, `raise ... from e`) when the store fails;
answer None or False for a missing object, never an error; never block the event loop (blocking
libraries go to a bounded thread pool below it, `tiers.threads.IOThreads`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar, cast, runtime_checkable

from tiering.errors import (
    ConfigError,
    CorruptObject,
    KeyFormatError,
    StateError,
    TierError,
    TierTimeout,
)
from tiering.format import (
    MAX_BLOCK_BYTES,
    REMOVABLE,
    WRITER_BYTES,
    Header,
    check_object,
    decode_header,
    decompress,
    encode,
    mac_key,
    verify_payload,
)
from tiering.keys import NAMESPACE_BYTES, BlockKey, key_from_hex
from tiering.options import TierOptions

__all__ = [
    "HEADER_ROOM",
    "MIN_SECRET_BYTES",
    "Buffer",
    "KeyLike",
    "NamespaceUsage",
    "ObjectInfo",
    "ReadsInto",
    "Tier",
    "TierStat",
    "as_key",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
KeyLike = BlockKey | bytes | str
"""A key as callers may give it: a `BlockKey`, its bytes, or its canonical hex form."""
Buffer = bytes | memoryview
"""Bytes a tier reads or writes without copying them: bytes, or a view of someone's buffer."""

HEADER_ROOM = 4096
"""Bytes a stored object may take before its payload (a header is at most 182 bytes, padded to
the writer's alignment): with the block's size, what `Tier.object_limit` allows."""
MIN_SECRET_BYTES = 16
"""The shortest deployment secret a tier accepts for authenticated objects."""


@dataclass(frozen=True, slots=True)
class TierStat:
    """What a tier holds, as `stat` answers it (any thread: a value)."""

    objects: int
    """Stored objects of this namespace (corrupt or foreign ones a backend cannot tell apart
    without reading them included)."""
    bytes_used: int
    """Bytes of those objects, headers included."""
    capacity: int | None
    """Bytes the tier may hold; None when unbounded or unknown."""


@dataclass(frozen=True, slots=True)
class NamespaceUsage:
    """What one namespace holds in a tier's store, store-wide: every engine's objects (any
    thread: a value). For operators (`kvtier stats`, `kvtier purge --idle-for`) and metrics."""

    namespace: bytes
    objects: int
    bytes_used: int
    """Bytes of its objects, headers included."""
    last_write: float | None = None
    """When the newest of its objects was written (Unix time); None when the store cannot say."""


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """A stored object as a listing sees it (any thread: a value)."""

    key: BlockKey
    size: int | None = None
    """Bytes of the stored object, when the listing knows."""
    modified: float | None = None
    """When it was written (Unix time), when the backend records it."""


@runtime_checkable
class ReadsInto(Protocol):
    """Optional fast path for raw objects (runtime thread, like every primitive): the payload
    goes straight into `payload` (a primary slot), without an intermediate copy.

    `Tier.get` calls `_read_into` instead of `_read` when the tier's class implements it and its
    codec is `raw` (a compressed payload must be decoded: it never fits in place).

    Parameters: `key`, the block's key; `payload`, the caller's buffer for the block (exactly
    the block's size, a writable byte view); `limit`, the largest object the caller can use.
    Returns: None when there is no object; else `(data, placed)`.

    Guaranteed by the caller: what `_read` is guaranteed; `payload` stays valid, and nobody
    else uses it, until the call has returned or raised (a cancelled read may still be writing
    into it: the caller then treats its bytes as garbage).

    The implementation must: raise `CorruptObject("length")` for an object larger than `limit`
    without reading it; set `placed` only when it read the payload into `payload`, which it may
    do only when the object is laid out as a header followed by exactly `len(payload)` bytes
    (its real size is the header's payload offset plus `len(payload)`, and the unverified
    header, `tiering.format.peek_lengths`, says a stored length of `len(payload)`), `data` then
    being exactly the first payload-offset bytes (the header); otherwise return the whole
    object as `data` (at most `limit` bytes) with `placed` false. The flag is what tells the two
    apart: an object cut at its payload offset is as long as a header. The caller verifies
    everything else (header, lengths, checksum, MAC) and treats `payload` as garbage unless it
    accepts the object.
    """

    async def _read_into(
        self, key: BlockKey, payload: memoryview, limit: int
    ) -> tuple[Buffer, bool] | None: ...


def as_key(key: KeyLike) -> BlockKey:
    """A key from bytes, or from its canonical hex form (anything else is `KeyFormatError`)."""
    if isinstance(key, str):
        return key_from_hex(key)
    if not isinstance(key, bytes) or not key:
        raise TypeError(f"a key is bytes or a hex string, got {type(key).__name__}")
    return BlockKey(key)


class Tier(ABC):
    """Base of every secondary tier: built in the scheduler process (or by an operator's
    `kvtier` command); every call runs on one event loop thread, the runtime's (`knows` and
    the attributes may be read from any thread).

    See the module docstring for what a backend writes and what it may rely on. Subclasses
    declare their settings as an options record (`Options`, a subclass of their parent's), and
    their capabilities as the class attributes below.
    """

    type_name: ClassVar[str] = ""
    """The name YAML's `type` gives this class (`tiering.registry`)."""
    persistent: ClassVar[bool] = False
    """Objects survive the tier's process and a restart."""
    shared: ClassVar[bool] = False
    """Several engines (hosts) can use the same tier at once."""
    medium: ClassVar[str] = "remote"
    """Where the tier keeps its blocks: "memory" (this host's RAM), "disk" (this host's
    storage) or "remote" (a server elsewhere). The engine is told where a hit came from by it
    (vLLM's `CacheHitSource`: host, disk, external_unspecified)."""
    supports_listing: ClassVar[bool] = False
    """The tier can list its keys (`keys`, `entries`): the backend implements `_list`."""
    evicts: ClassVar[bool] = False
    """The tier enforces `capacity` itself by evicting least recently used objects."""
    align: ClassVar[int] = 1
    """Payload offset alignment in stored objects (a file tier with O_DIRECT uses 4096)."""
    writes_once: bool = False
    """This tier's puts leave an object already stored for the key in place (`_write` answers
    False): set by a backend, per instance, where its store allows it (Redis `SET NX`, an S3
    conditional put, an exclusive create)."""
    indexed: ClassVar[bool] = False
    """The tier keeps an in-process index of the objects it holds, so `knows` answers without
    I/O and the tiering manager needs no existence checks while the tier is its store's only
    writer (while other processes write the store, `knows` may answer None for a key the index
    lacks: the manager then asks `contains`)."""
    Options: ClassVar[type[TierOptions]] = TierOptions
    """The record of the settings this class takes (YAML keys and constructor keywords)."""

    options: TierOptions
    """This tier's settings, read by `Options.of` from the constructor's keywords."""

    def __init__(
        self,
        *,
        namespace: bytes,
        secret: bytes | None = None,
        name: str | None = None,
        **options: Any,
    ) -> None:
        """`namespace`: the digest whose blocks this tier serves (`tiering.keys`); `secret`:
        the deployment's secret for authenticated objects (at least `MIN_SECRET_BYTES`): every
        object is written with a MAC, and one without a valid MAC is a miss; `name`: the tier's
        name in messages and metrics (default: `type_name`); `options`: the settings of
        `Options`, as Python values (bytes, seconds) or YAML ones (`8GiB`, `200ms`). Raises
        `ConfigError` naming the option that is unknown or wrong."""
        if len(namespace) != NAMESPACE_BYTES:
            raise ConfigError(f"namespace: expected {NAMESPACE_BYTES} bytes, got {len(namespace)}")
        self.options = self.Options.of(options)
        if secret is not None and len(secret) < MIN_SECRET_BYTES:
            raise ConfigError(f"secret: at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
        self.namespace = namespace
        self.name = name or self.type_name
        self.capacity = self.options.capacity
        self.codec = self.options.codec
        self.checksum = self.options.checksum
        self.read_only = self.options.read_only
        self.concurrency = self.options.concurrency
        self.timeout = self.options.timeout
        self._mac_key = None if secret is None else mac_key(bytes(secret))
        self.writer = os.urandom(WRITER_BYTES)
        """This tier's id in the writer tag of every object it writes: a hit on an object
        another id wrote is counted under `hits_other_writer`."""
        # once: a runtime_checkable isinstance walks the protocol's members, too slow for
        # every get
        self._reads_into = isinstance(self, ReadsInto)
        self.counters: Counter[str] = Counter()
        """Events by name: hits, misses, puts, deletes, bytes_read, bytes_written, errors,
        corrupt.<reason> (`tiering.format.REASONS`), evictions, duplicates and
        duplicate_bytes (puts the store already held: nothing written), hits_other_writer
        (hits on objects another tier instance wrote: another engine, or an earlier run)."""
        self.damaged: list[tuple[str, str, bool]] = []
        """(where, reason, removed) of each stored object a start-up scan found damaged and
        did not index (`kvtier verify` reports them): a read-only tier leaves them in place."""
        self._closed = False

    @classmethod
    def variant(cls, options: Mapping[str, Any]) -> type[Tier]:
        """The class to build for `options` (the raw mapping, before it is read): a tier class
        whose options pick a concrete class (a file tier's `layout`) returns it, so that each
        variant declares and accepts only its own options. Default: this class."""
        return cls

    # -- primitives a backend writes ------------------------------------------------------------

    @abstractmethod
    async def _read(self, key: BlockKey, limit: int) -> Buffer | None:
        """The stored object of `key` as `_write` got it (header and payload), or None.

        Parameters: `key`, the block's key; `limit`, the largest object the caller can use
        (`object_limit` of its block's size, or of `MAX_BLOCK_BYTES` for an operator's read).
        Returns: the object's bytes (the caller may keep them), or None when there is none.

        Guaranteed by the caller (see the module docstring): a validated key, the event loop
        thread, the tier's deadline; the object is verified by the caller.
        The implementation must: raise `CorruptObject("length")` without reading the object
        when it is larger than `limit` bytes (known from the store: a file's length, a value's
        length, a response's Content-Length), and never read more than `limit` bytes of it (one
        more, to see that it is longer, is fine); answer None for a missing object; raise a
        `TierError` when the store fails.
        """

    @abstractmethod
    async def _write(self, key: BlockKey, parts: Sequence[Buffer]) -> bool | None:
        """Store `b"".join(parts)` as the object of `key`, replacing any.

        Parameters: `key`, the block's key; `parts`, the object in pieces (the header, then the
        payload: `tiering.format.encode`), to write without joining them where the store can.

        Returns: None or True when written; False when the store already held an object of
        `key` and nothing was written (counted under `duplicates` and `duplicate_bytes`).

        Guaranteed by the caller: the tier is not read-only; `parts` stay valid and unchanged
        until the call returns or raises (the payload is often a view of a primary slot, which
        is pinned until then).
        The implementation must: be atomic for readers (a reader sees the old object, the new
        one, or none: never a mix, never a torn object); keep no reference to `parts` after it
        returns (copy what it holds on to); on a tier that `evicts`, stay within `capacity` by
        evicting least recently used objects (counted as `evictions`) and raise `TierFull` for
        an object larger than the capacity; raise a `TierError` when the store fails.
        The implementation may: write once where the store allows it (Redis `SET NX`, an S3
        conditional put, an exclusive create), leaving an object already there in place and
        answering False: engines sharing a store then write a block once between them. Two
        engines of one namespace write the same bytes for a key; a damaged object is deleted
        by the reader that finds it (`REMOVABLE`), and one this tier cannot read (another
        secret's) is a neighbour's, which it must not replace.
        """

    @abstractmethod
    async def _delete(self, key: BlockKey) -> bool:
        """Remove the object of `key`; whether there was one.

        Guaranteed by the caller: the tier is not read-only (`get` deletes refused objects
        through this, except on a read-only tier).
        The implementation must: answer False for a missing object (not an error); leave no
        part of the object readable once it returns True.
        """

    @abstractmethod
    async def _contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each of `keys` has an object, in order (existence only: whether the object
        is sound is for `get` to find).

        Guaranteed by the caller: `keys` is not empty.
        The implementation must: answer in one round trip where the store allows (a pipeline,
        a batch request): the manager checks a whole request's keys at once.
        """

    @abstractmethod
    async def _stat(self) -> TierStat:
        """What the tier holds for this namespace (`TierStat`), with `capacity` the tier's own
        (`self.capacity`, or what the store reports).

        The implementation may: take time proportional to the number of objects (a listing):
        it is for operators and metrics, not for the data path.
        """

    async def _list(self) -> AsyncIterator[BlockKey]:
        """Keys of this namespace (backends with `supports_listing` override this).

        The implementation must: yield each key once; skip names no kvtier wrote, counting
        them (`listed_key`): anyone who can write to a shared store may put anything there.
        """
        raise StateError(f"tier {self.name!r} ({self.type_name}) cannot list its keys")
        yield BlockKey(b"")  # pragma: no cover - makes this an async generator

    async def _entries(self) -> AsyncIterator[ObjectInfo]:
        """Objects of this namespace with what the backend knows of them (default: `_list`'s
        keys alone). Override where a listing gives sizes and write times for free."""
        async for key in self._list():
            yield ObjectInfo(key)

    async def _read_head(self, key: BlockKey, n: int) -> tuple[Buffer, int] | None:
        """The first `n` bytes of the stored object of `key` and its real size, or None.

        Backends that can read a range override this (the default reads the object, up to the
        largest one an operator may read). The implementation must: read no more than `n`
        bytes of the object, whatever its size.
        """
        blob = await self._read(key, self.object_limit(MAX_BLOCK_BYTES))
        return None if blob is None else (memoryview(blob)[:n], len(blob))

    async def _namespaces(self) -> list[bytes]:
        """Every namespace with objects in this tier (default: only this one). Override where
        the store's names tell them (a prefix per namespace)."""
        return [self.namespace]

    async def _delete_refused(self, key: BlockKey) -> bool:
        """Remove the copy of `key` a read just refused as provably damaged (`_refuse`).
        Default: `_delete`. Override where a key may have several copies (an S3 block in a
        pack and as a single object): only the one read was proved damaged."""
        return await self._delete(key)

    async def _usage(self) -> list[NamespaceUsage]:
        """What every namespace holds in the tier's store, store-wide (every engine's objects
        at the tier's location: its directory, key prefix or bucket prefix). Default: this
        namespace, from `_stat`, without a write time. Override where the store can tell
        (listings with sizes and times).

        The implementation must: list only namespaces that hold objects, each object once
        (`objects` counts block objects: a pack's blocks, a segment's records); keep its memory
        bounded whatever the store holds (stream the listing; `tiering.usage.UsageTally`
        bounds the namespaces); be cancellable (a deadline), leaving no thread of its working
        on past it for long.
        The implementation may: take time proportional to the store's objects (it is for
        operators and the usage metrics, never the data path)."""
        stat = await self._stat()
        if not stat.objects:
            return []
        return [NamespaceUsage(self.namespace, stat.objects, stat.bytes_used)]

    async def _close(self) -> None:  # noqa: B027 - optional: most tiers hold something to release
        """Release connections, files and threads; called once, by the first `close`. The
        implementation must: first write out any object it still holds only in memory (the S3
        tier's blocks waiting for a pack)."""

    # -- the public API ---------------------------------------------------------------------------
    # Called by the manager's jobs on the runtime thread, and by operators' commands. Keys may
    # be given as `KeyLike`; an invalid one raises `KeyFormatError` before any I/O. A failure of
    # the store raises a `TierError` (`TierTimeout` past the deadline); a corrupt object is a
    # miss, never an error, except where an operator's call says otherwise.

    @property
    def header_room(self) -> int:
        """Bytes a stored object of this tier may take before its payload."""
        return max(HEADER_ROOM, self.align)

    def listed_key(self, name: bytes | str) -> BlockKey | None:
        """The key a stored name gives (a key's hex form, as kvtier writes names), or None,
        counted under `foreign_names`, for a name no kvtier wrote: anyone who can write to a
        shared store may put anything there, and one odd name must not stop a listing."""
        try:
            return key_from_hex(name.decode() if isinstance(name, bytes) else name)
        except (KeyFormatError, UnicodeDecodeError):
            self.counters["foreign_names"] += 1
            return None

    def object_limit(self, block_bytes: int) -> int:
        """The largest stored object this tier can hold for a block of `block_bytes`: a header
        and its padding, and the block (a stored payload is never longer than its block)."""
        return self.header_room + block_bytes

    @property
    def authenticated(self) -> bool:
        """Whether objects are written with, and required to carry, a MAC (`secret`)."""
        return self._mac_key is not None

    async def get(self, key: KeyLike, into: memoryview | bytearray) -> bool:
        """Read the block of `key` into `into` (exactly its size); whether it was found.

        A corrupt, truncated, foreign, unauthenticated or wrongly sized object is a miss: it is
        counted under `corrupt.<reason>` and, when the damage is provable
        (`tiering.format.REMOVABLE`), deleted unless the tier is read-only. After a miss `into`
        holds no block (it may hold garbage: a caller uses it only after a hit).
        """
        block = as_key(key)
        view = memoryview(into).cast("B")
        limit = self.object_limit(len(view))
        try:
            if self._reads_into and self.codec == "raw":
                raw = await self._call(cast(ReadsInto, self)._read_into(block, view, limit))
                return await self._accept_into(block, raw, view)
            blob = await self._call(self._read(block, limit))
        except CorruptObject as e:
            await self._refuse(block, e)
            return False
        return await self._accept(block, blob, view)

    async def _accept_into(
        self, block: BlockKey, got: tuple[Buffer, bool] | None, view: memoryview
    ) -> bool:
        """Verify what a `_read_into` returned: a header with its payload already in `view`, or
        the whole object when the backend did not place the payload (`ReadsInto`)."""
        if got is None:
            return self._miss()
        data, placed = got
        if not placed:
            return await self._accept(block, data, view)
        try:
            header = self.verify_placed(block, data, view)
        except CorruptObject as e:
            await self._refuse(block, e)
            return False
        return self._hit(len(view), header)

    def verify_placed(self, block: BlockKey, header_bytes: Buffer, view: memoryview) -> Header:
        """Check a header and the payload a backend read straight into `view` (`ReadsInto`):
        `CorruptObject` unless they are `block`'s, of this namespace, raw, with a matching
        checksum (and MAC); the checked header. Pure: any thread (a backend may check in its
        I/O threads, and count the hit on the loop: `_hit`)."""
        header = decode_header(header_bytes, block, self.namespace)
        if header.payload_offset != len(header_bytes):
            raise CorruptObject("length", "the payload was read from another offset than its own")
        if header.codec != "raw":
            raise CorruptObject("codec", f"expected a raw object, found {header.codec}")
        check_object(header, header.payload_offset + len(view), len(view))
        verify_payload(header, view, self._mac_key)
        return header

    async def _accept(self, block: BlockKey, blob: Buffer | None, view: memoryview) -> bool:
        """Verify a stored object read by a backend and copy its block into `view`."""
        if blob is None:
            return self._miss()
        try:
            header, block_bytes = self.verified(block, blob, len(view))
            view[:] = block_bytes
        except CorruptObject as e:
            await self._refuse(block, e)
            return False
        return self._hit(len(view), header)

    def verified_block(self, key: BlockKey, blob: Buffer, size: int | None = None) -> Buffer:
        """The block a stored object holds, verified as a read would verify it (header, real
        size, checksum, MAC with a secret, bounded decoding); `size`: the block size expected.
        Raises `CorruptObject`."""
        return self.verified(key, blob, size)[1]

    def verified(
        self, key: BlockKey, blob: Buffer, size: int | None = None
    ) -> tuple[Header, Buffer]:
        """`verified_block` with the object's checked header."""
        blob = memoryview(blob)
        header = decode_header(blob, key, self.namespace)
        check_object(header, len(blob), size)
        payload = blob[header.payload_offset : header.object_length]
        verify_payload(header, payload, self._mac_key)
        return header, decompress(header.codec, payload, header.raw_length)

    def decode_header(self, key: BlockKey, head: Buffer) -> Header:
        """The checked header of the object of `key` whose first bytes are `head`."""
        return decode_header(head, key, self.namespace)

    def _hit(self, size: int, header: Header) -> bool:
        """Count a verified hit of `size` bytes on the object of `header` (the loop thread)."""
        self.counters["hits"] += 1
        self.counters["bytes_read"] += size
        if header.writer is not None and header.writer != self.writer:
            self.counters["hits_other_writer"] += 1
        return True

    def _encode(
        self, key: KeyLike, data: Buffer | bytearray
    ) -> tuple[BlockKey, tuple[Buffer, Buffer]]:
        """The validated key and the object's parts (header, payload) for block `data`, as
        `put` writes them (for backends whose batches write their own way); `StateError` on a
        read-only tier."""
        block = as_key(key)
        self._writable("put")
        header, payload = encode(
            block,
            self.namespace,
            memoryview(data),
            codec=self.codec,
            checksum_kind=self.checksum,
            align=self.align,
            secret_key=self._mac_key,
            writer=self.writer,
        )
        return block, (header, payload)

    async def get_bytes(self, key: KeyLike, size: int) -> bytes | None:
        """The block of `key` (of `size` bytes) as bytes, or None: `get` for callers without a
        buffer of their own."""
        out = bytearray(size)
        return bytes(out) if await self.get(key, out) else None

    async def put(self, key: KeyLike, data: Buffer | bytearray) -> None:
        """Store `data` as the block of `key`, replacing any; `StateError` on a read-only tier.
        `data` must stay unchanged until the call returns (it is written from where it lies)."""
        block, parts = self._encode(key, data)
        self._count_put(await self._call(self._write(block, parts)), len(data))

    def _count_put(self, written: bool | None, size: int) -> None:
        """Count a put of a `size`-byte block that `_write` answered `written` for (False:
        the store held the key already; for backends whose batches write their own way)."""
        self.counters["puts"] += 1
        if written is False:
            self.counters["duplicates"] += 1
            self.counters["duplicate_bytes"] += size
        else:
            self.counters["bytes_written"] += size

    async def delete(self, key: KeyLike) -> bool:
        """Remove the block of `key`; whether there was one. `StateError` on a read-only tier."""
        block = as_key(key)
        self._writable("delete")
        found = await self._call(self._delete(block))
        self.counters["deletes"] += found
        return found

    def knows(self, key: BlockKey) -> bool | None:
        """Whether an `indexed` tier holds `key`, from its index: no I/O, callable from any
        thread (one dict lookup, atomic under the GIL). None when the tier cannot say without
        asking its store (not `indexed`, or a key its index lacks while other processes write
        its store): use `contains`."""
        return None

    def newest(self, n: int) -> list[BlockKey]:
        """Up to `n` of the keys an `indexed` tier holds, the most recently written or read
        first, from its index (no I/O; the runtime's thread, like the primitives, or any
        thread before the tier's first call): what a warm start reads into the primary
        (`primary.warm_start`). A tier without an index answers none."""
        return []

    async def contains(self, keys: Sequence[KeyLike]) -> list[bool]:
        """Whether each key has a block (existence only: a corrupt object is found by `get`)."""
        blocks = [as_key(k) for k in keys]
        return await self._call(self._contains(blocks)) if blocks else []

    async def keys(self) -> AsyncIterator[BlockKey]:
        """Every key of this tier's namespace (tiers with `supports_listing`)."""
        if not self.supports_listing:
            raise StateError(f"tier {self.name!r} ({self.type_name}) cannot list its keys")
        async for key in self._list():
            yield key

    async def entries(self) -> AsyncIterator[ObjectInfo]:
        """`keys` with each object's size and write time where the backend knows them."""
        if not self.supports_listing:
            raise StateError(f"tier {self.name!r} ({self.type_name}) cannot list its keys")
        async for info in self._entries():
            yield info

    async def namespaces(self) -> list[bytes]:
        """The namespaces that have objects in this tier (for operators)."""
        return await self._call(self._namespaces())

    async def read_object(self, key: KeyLike) -> Buffer | None:
        """The stored object of `key` as it is (header and payload), unverified: for
        operators' tools that inspect or move objects. An object larger than any block may be
        (`tiering.format.MAX_BLOCK_BYTES`) raises `CorruptObject("length")` unread."""
        return await self._call(self._read(as_key(key), self.object_limit(MAX_BLOCK_BYTES)))

    async def read_head(self, key: KeyLike) -> tuple[bytes, int] | None:
        """The first `header_room` bytes of the stored object of `key` (its header) and the
        object's real size, unverified; None when absent. For listings and inspection: it
        reads no payload."""
        got = await self._call(self._read_head(as_key(key), self.header_room))
        return None if got is None else (bytes(got[0]), got[1])

    async def stat(self) -> TierStat:
        """What the tier holds (`TierStat`); may list the store: for operators and metrics."""
        return await self._call(self._stat())

    async def usage(self, timeout: float | None = None) -> list[NamespaceUsage]:
        """What every namespace holds in the tier's store, store-wide (`_usage`): for
        operators and metrics; it lists the store. The tier's `timeout` (sized for one
        block's call) does not bound it: `timeout` does (None: only each request's own), and
        past it the call raises `TierTimeout`. A failure is not counted among the tier's
        `errors`: it is no call of the data path."""
        try:
            async with asyncio.timeout(timeout):
                return await self._usage()
        except TimeoutError as e:
            if isinstance(e, TierError):
                raise
            raise TierTimeout(f"tier {self.name!r}: usage not listed within {timeout:g}s") from e

    async def close(self) -> None:
        """Release what the tier holds (`_close`), once; later calls do nothing."""
        if not self._closed:
            self._closed = True
            await self._close()

    async def __aenter__(self: T) -> T:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- batches ----------------------------------------------------------------------------------

    async def get_many(
        self, items: Sequence[tuple[KeyLike, memoryview | bytearray]]
    ) -> list[bool | BaseException]:
        """`get` for each (key, buffer), at most `concurrency` at a time; a failure is returned
        in its place, not raised."""
        return await self._bounded([self.get(k, b) for k, b in items])

    async def put_many(
        self, items: Sequence[tuple[KeyLike, Buffer | bytearray]]
    ) -> list[None | BaseException]:
        """`put` for each (key, data), at most `concurrency` at a time; a failure is returned
        in its place, not raised. Backends with a batch request override this (and
        `get_many`): each item must still be encoded, counted and verified as `put` / `get`
        would (`_encode`, `_accept_into`, `_refuse`)."""
        return await self._bounded([self.put(k, d) for k, d in items])

    async def delete_many(self, keys: Sequence[KeyLike]) -> list[bool | BaseException]:
        """`delete` for each key, at most `concurrency` at a time; failures in their place."""
        return await self._bounded([self.delete(k) for k in keys])

    async def _bounded(self, calls: Sequence[Awaitable[T]]) -> list[T | BaseException]:
        gate = asyncio.Semaphore(self.concurrency)

        async def one(call: Awaitable[T]) -> T:
            try:
                await gate.acquire()
            except BaseException:  # cancelled while queued: the call never starts
                if isinstance(call, Coroutine):
                    call.close()
                raise
            try:
                return await call
            finally:
                gate.release()

        return await asyncio.gather(*(one(c) for c in calls), return_exceptions=True)

    # -- helpers ----------------------------------------------------------------------------------

    async def _call(self, operation: Awaitable[T]) -> T:
        """Every backend call, under the tier's deadline; a library error the backend did not
        translate counts as an error and propagates."""
        try:
            if self.timeout is None:
                return await operation
            async with asyncio.timeout(self.timeout):
                return await operation
        except TimeoutError as e:
            self.counters["errors"] += 1
            if isinstance(e, TierError):
                raise
            raise TierTimeout(f"tier {self.name!r}: no answer within {self.timeout:g}s") from e
        except CorruptObject:
            raise  # the object's fault, not the tier's: counted as corrupt where refused
        except TierError:
            self.counters["errors"] += 1
            raise

    def _miss(self) -> bool:
        self.counters["misses"] += 1
        return False

    async def _refuse(self, key: BlockKey, error: CorruptObject) -> None:
        """Count `error` as a corrupt miss of `key` and, when it proves the object damaged
        (`tiering.format.REMOVABLE`) and the tier is writable, delete it, as `get` does (for
        backends whose batches refuse objects themselves). An object of another secret,
        namespace or format is a neighbour's: left in place."""
        self.counters["misses"] += 1
        self.counters[f"corrupt.{error.reason}"] += 1
        removable = error.reason in REMOVABLE
        log.warning(
            "tier %r: object %s refused (%s)%s",
            self.name,
            key.hex(),
            error,
            "" if removable else "; left in place",
        )
        if removable and not self.read_only:
            try:
                await self._call(self._delete_refused(key))
            except TierError as e:
                log.warning("tier %r: cannot delete refused object %s: %s", self.name, key.hex(), e)

    def _writable(self, what: str) -> None:
        if self.read_only:
            raise StateError(f"tier {self.name!r} is read-only: cannot {what}")
