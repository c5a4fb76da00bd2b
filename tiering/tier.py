"""The secondary-tier contract.

A backend implements a handful of async primitives over *stored objects* (the bytes of
`tiering.format`: header, then payload) and declares what it can do; `Tier` adds everything
else: encoding and verification of every object, the public `get(key, into)` / `put(key, data)`
over block payloads, batched forms with bounded concurrency, a deadline on every call, read-only
mode, authenticated objects (`secret`), counters, and the async context manager.

    class MyTier(Tier):
        type_name = "mine"
        persistent = True
        async def _read(self, key, limit): ...   # the stored object, or None
        async def _write(self, key, parts): ...  # store b"".join(parts) atomically
        async def _delete(self, key): ...        # True if it was there
        async def _contains(self, keys): ...     # one bool per key
        async def _stat(self): ...               # TierStat
        # optional: _list(), _close(), _read_head(key, n), _read_into(...) (the `ReadsInto`
        # fast path), knows(key) with `indexed = True` (an in-process index of every object)

What the base class guarantees a backend: keys are `BlockKey`s already validated (no path or
name comes from input); `limit` is the largest object the caller can use (`object_limit`);
every call runs under the tier's deadline on the runtime's event loop thread; nothing a backend
returns is trusted: every object is verified here before a byte of it reaches a caller's block.

What a backend must do: never read or allocate more than `limit` bytes for one object (a store
holding a larger one answers `CorruptObject("length")` without reading it: a crafted 2 GiB object
costs a stat, not 2 GiB); raise `TierUnavailable`, `TierTimeout` or `TierFull` (translated from
its library's errors) when it fails; answer None or False for a missing object, never an error.
Blocking libraries go to a bounded thread pool below the loop.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Coroutine, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, TypeVar, cast, runtime_checkable

from tiering.errors import (
    ConfigError,
    CorruptObject,
    KeyFormatError,
    StateError,
    TierError,
    TierTimeout,
)
from tiering.format import (
    CHECKSUMS,
    CODECS,
    MAX_BLOCK_BYTES,
    Header,
    check_object,
    decode_header,
    decompress,
    encode,
    mac_key,
    verify_payload,
)
from tiering.keys import NAMESPACE_BYTES, BlockKey, key_from_hex

__all__ = [
    "HEADER_ROOM",
    "MIN_SECRET_BYTES",
    "ObjectInfo",
    "ReadsInto",
    "Tier",
    "TierStat",
    "as_key",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
KeyLike = BlockKey | bytes | str
Buffer = bytes | memoryview

HEADER_ROOM = 4096
"""Bytes a stored object may take before its payload (a header is at most 166 bytes, padded to
the writer's alignment): with the block's size, what `Tier.object_limit` allows."""
MIN_SECRET_BYTES = 16


@dataclass(frozen=True, slots=True)
class TierStat:
    objects: int
    bytes_used: int
    capacity: int | None
    """Bytes the tier may hold; None when unbounded or unknown."""


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """A stored object as a listing sees it."""

    key: BlockKey
    size: int | None = None
    """Bytes of the stored object, when the listing knows."""
    modified: float | None = None
    """When it was written (Unix time), when the backend records it."""


@runtime_checkable
class ReadsInto(Protocol):
    """Fast path for raw objects: the payload goes straight into `payload` (a primary slot),
    without an intermediate copy.

    The implementation must: return None when there is no object; raise `CorruptObject("length")`
    for an object larger than `limit` without reading it; otherwise return `(data, placed)`:
    `placed` only when it read the payload into `payload`, which it may do only when the
    object is laid out as a header followed by exactly `len(payload)` bytes (its real size is
    the header's payload offset plus `len(payload)`, and the unverified header,
    `tiering.format.peek_lengths`, says a stored length of `len(payload)`), `data` then being
    exactly the first payload-offset bytes (the header); else `data` is the whole object (at
    most `limit` bytes). The flag is what tells the two apart: an object cut at its payload
    offset is as long as a header. The caller verifies everything else (header, lengths,
    checksum, MAC) and treats `payload` as garbage unless it accepts the object."""

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
    """Base of every secondary tier (see the module docstring for what a backend writes)."""

    type_name: ClassVar[str] = ""
    persistent: ClassVar[bool] = False
    """Objects survive the tier's process and a restart."""
    shared: ClassVar[bool] = False
    """Several engines (hosts) can use the same tier at once."""
    supports_listing: ClassVar[bool] = False
    evicts: ClassVar[bool] = False
    """The tier enforces `capacity` itself by evicting least recently used objects."""
    align: ClassVar[int] = 1
    """Payload offset alignment in stored objects (a file tier with O_DIRECT uses 4096)."""
    indexed: ClassVar[bool] = False
    """The tier keeps an in-process index of every object it holds (it is its store's only
    writer), so `knows` answers without I/O and the tiering manager needs no existence checks."""

    def __init__(
        self,
        *,
        namespace: bytes,
        name: str | None = None,
        capacity: int | None = None,
        codec: str = "raw",
        checksum: str = "xxh3",
        read_only: bool = False,
        concurrency: int = 16,
        timeout: float | None = 5.0,
        secret: bytes | None = None,
    ) -> None:
        """`secret`: the deployment's secret for authenticated objects (at least 16 bytes):
        every object is written with a MAC, and one without a valid MAC is a miss."""
        if len(namespace) != NAMESPACE_BYTES:
            raise ConfigError(f"namespace: expected {NAMESPACE_BYTES} bytes, got {len(namespace)}")
        if codec not in CODECS:
            raise ConfigError(f"codec: expected one of {', '.join(CODECS)}, got {codec!r}")
        if checksum not in CHECKSUMS:
            raise ConfigError(f"checksum: expected one of {', '.join(CHECKSUMS)}, got {checksum!r}")
        if capacity is not None and capacity <= 0:
            raise ConfigError(f"capacity: must be positive, got {capacity}")
        if concurrency <= 0:
            raise ConfigError(f"concurrency: must be positive, got {concurrency}")
        if secret is not None and len(secret) < MIN_SECRET_BYTES:
            raise ConfigError(f"secret: at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
        self.namespace = namespace
        self.name = name or self.type_name
        self.capacity = capacity
        self.codec = codec
        self.checksum = checksum
        self.read_only = read_only
        self.concurrency = concurrency
        self.timeout = timeout
        self._mac_key = None if secret is None else mac_key(bytes(secret))
        self._reads_into = isinstance(self, ReadsInto)  # once: a protocol check takes ~40 µs
        self.counters: Counter[str] = Counter()
        """Events by name: hits, misses, puts, deletes, bytes_read, bytes_written, errors,
        corrupt.<reason> (`tiering.format.REASONS`), evictions."""
        self.damaged: list[tuple[str, str, bool]] = []
        """(where, reason, removed) of each stored object a start-up scan found damaged and
        did not index (`kvtier verify` reports them): a read-only tier leaves them in place."""
        self._closed = False

    # -- primitives a backend writes ------------------------------------------------------------

    @abstractmethod
    async def _read(self, key: BlockKey, limit: int) -> Buffer | None:
        """The stored object of `key`, or None; `CorruptObject("length")` without reading it when
        it is larger than `limit` bytes."""

    @abstractmethod
    async def _write(self, key: BlockKey, parts: Sequence[Buffer]) -> None:
        """Store `b"".join(parts)` as the object of `key`, replacing any; atomic for readers."""

    @abstractmethod
    async def _delete(self, key: BlockKey) -> bool:
        """Remove the object of `key`; whether there was one."""

    @abstractmethod
    async def _contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key has an object (one round trip where the backend allows)."""

    @abstractmethod
    async def _stat(self) -> TierStat: ...

    async def _list(self) -> AsyncIterator[BlockKey]:
        """Keys of this namespace (backends with `supports_listing`)."""
        raise StateError(f"tier {self.name!r} ({self.type_name}) cannot list its keys")
        yield BlockKey(b"")  # pragma: no cover - makes this an async generator

    async def _entries(self) -> AsyncIterator[ObjectInfo]:
        """Objects of this namespace with what the backend knows of them (default: keys)."""
        async for key in self._list():
            yield ObjectInfo(key)

    async def _read_head(self, key: BlockKey, n: int) -> tuple[Buffer, int] | None:
        """The first `n` bytes of the stored object of `key` and its real size, or None.
        Backends that can read a range override this (the default reads the object, up to the
        largest one an operator may read)."""
        blob = await self._read(key, self.object_limit(MAX_BLOCK_BYTES))
        return None if blob is None else (memoryview(blob)[:n], len(blob))

    async def _namespaces(self) -> list[bytes]:
        """Every namespace with objects in this tier (default: only this one)."""
        return [self.namespace]

    async def _close(self) -> None:  # noqa: B027 - optional: most tiers hold something to release
        """Release connections, files and threads."""

    # -- the public API ---------------------------------------------------------------------------

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
        counted under `corrupt.<reason>` and deleted unless the tier is read-only. After a miss
        `into` holds no block (it may hold garbage: a caller uses it only after a hit).
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
            header = decode_header(data, block, self.namespace)
            if header.payload_offset != len(data):
                raise CorruptObject(
                    "length", "the payload was read from another offset than its own"
                )
            if header.codec != "raw":
                raise CorruptObject("codec", f"expected a raw object, found {header.codec}")
            check_object(header, header.payload_offset + len(view), len(view))
            verify_payload(header, view, self._mac_key)
        except CorruptObject as e:
            await self._refuse(block, e)
            return False
        return self._hit(len(view))

    async def _accept(self, block: BlockKey, blob: Buffer | None, view: memoryview) -> bool:
        """Verify a stored object read by a backend and copy its block into `view`."""
        if blob is None:
            return self._miss()
        try:
            view[:] = self.verified_block(block, blob, len(view))
        except CorruptObject as e:
            await self._refuse(block, e)
            return False
        return self._hit(len(view))

    def verified_block(self, key: BlockKey, blob: Buffer, size: int | None = None) -> Buffer:
        """The block a stored object holds, verified as a read would verify it (header, real
        size, checksum, MAC with a secret, bounded decoding); `size`: the block size expected.
        Raises `CorruptObject`."""
        blob = memoryview(blob)
        header = decode_header(blob, key, self.namespace)
        check_object(header, len(blob), size)
        payload = blob[header.payload_offset : header.object_length]
        verify_payload(header, payload, self._mac_key)
        return decompress(header.codec, payload, header.raw_length)

    def decode_header(self, key: BlockKey, head: Buffer) -> Header:
        """The checked header of the object of `key` whose first bytes are `head`."""
        return decode_header(head, key, self.namespace)

    def _hit(self, size: int) -> bool:
        self.counters["hits"] += 1
        self.counters["bytes_read"] += size
        return True

    def _encode(
        self, key: KeyLike, data: Buffer | bytearray
    ) -> tuple[BlockKey, tuple[Buffer, Buffer]]:
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
        )
        return block, (header, payload)

    async def get_bytes(self, key: KeyLike, size: int) -> bytes | None:
        """The block of `key` (of `size` bytes) as bytes, or None: `get` for callers without a
        buffer of their own."""
        out = bytearray(size)
        return bytes(out) if await self.get(key, out) else None

    async def put(self, key: KeyLike, data: Buffer | bytearray) -> None:
        """Store `data` as the block of `key`, replacing any."""
        block, parts = self._encode(key, data)
        await self._call(self._write(block, parts))
        self.counters["puts"] += 1
        self.counters["bytes_written"] += len(data)

    async def delete(self, key: KeyLike) -> bool:
        block = as_key(key)
        self._writable("delete")
        found = await self._call(self._delete(block))
        self.counters["deletes"] += found
        return found

    def knows(self, key: BlockKey) -> bool | None:
        """Whether an `indexed` tier holds `key`, from its index: no I/O, callable from any
        thread (one dict lookup, atomic under the GIL). None when the tier cannot say without
        asking its store (not `indexed`): use `contains`."""
        return None

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
        return await self._call(self._stat())

    async def close(self) -> None:
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
        return await self._bounded([self.put(k, d) for k, d in items])

    async def delete_many(self, keys: Sequence[KeyLike]) -> list[bool | BaseException]:
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
        self.counters["misses"] += 1
        self.counters[f"corrupt.{error.reason}"] += 1
        log.warning("tier %r: object %s refused (%s)", self.name, key.hex(), error)
        if not self.read_only:
            try:
                await self._call(self._delete(key))
            except TierError as e:
                log.warning("tier %r: cannot delete refused object %s: %s", self.name, key.hex(), e)

    def _writable(self, what: str) -> None:
        if self.read_only:
            raise StateError(f"tier {self.name!r} is read-only: cannot {what}")
