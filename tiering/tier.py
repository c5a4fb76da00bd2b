"""The secondary-tier contract.

A backend implements a handful of async primitives over *stored objects* (the bytes of
`tiering.format`: header, then payload) and declares what it can do; `Tier` adds everything
else: encoding and verification of every object, the public `get(key, into)` / `put(key, data)`
over block payloads, batched forms with bounded concurrency, a deadline on every call, read-only
mode, counters, and the async context manager.

    class MyTier(Tier):
        type_name = "mine"
        persistent = True
        async def _read(self, key): ...          # the stored object, or None
        async def _write(self, key, parts): ...  # store b"".join(parts) atomically
        async def _delete(self, key): ...        # True if it was there
        async def _contains(self, keys): ...     # one bool per key
        async def _stat(self): ...               # TierStat
        # optional: _list(), _close(), _read_into(...) (the `ReadsInto` fast path),
        # knows(key) with `indexed = True` (an in-process index of every object)

Backends raise `TierUnavailable`, `TierTimeout` or `TierFull` (translated from their library's
errors) when they fail; a missing object is None or False, never an error. Runs on the kvtier
runtime's event loop thread; blocking libraries go to a bounded thread pool below it.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Coroutine, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, TypeVar, cast, runtime_checkable

from tiering.errors import ConfigError, StateError, TierError, TierTimeout
from tiering.format import (
    CHECKSUMS,
    CODECS,
    Corrupt,
    decode_header,
    decompress,
    encode,
    verify_payload,
)
from tiering.keys import NAMESPACE_BYTES, BlockKey, key_from_hex

__all__ = ["ObjectInfo", "ReadsInto", "Tier", "TierStat", "as_key"]

log = logging.getLogger(__name__)

T = TypeVar("T")
KeyLike = BlockKey | bytes | str
Buffer = bytes | memoryview


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
    """Fast path for raw objects: return the stored object's header bytes (at least up to its
    payload offset) and read its payload straight into `payload` (a primary slot), without an
    intermediate copy; None when there is no object. When the stored payload length is not
    `len(payload)` the payload is left unread (`tiering.format.peek_lengths` tells), and the
    caller refuses the object."""

    async def _read_into(self, key: BlockKey, payload: memoryview) -> bytes | None: ...


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
    ) -> None:
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
        self.namespace = namespace
        self.name = name or self.type_name
        self.capacity = capacity
        self.codec = codec
        self.checksum = checksum
        self.read_only = read_only
        self.concurrency = concurrency
        self.timeout = timeout
        self._reads_into = isinstance(self, ReadsInto)  # once: a protocol check takes ~40 µs
        self.counters: Counter[str] = Counter()
        """Events by name: hits, misses, puts, deletes, bytes_read, bytes_written, errors,
        corrupt.<reason>, evictions."""
        self._closed = False

    # -- primitives a backend writes ------------------------------------------------------------

    @abstractmethod
    async def _read(self, key: BlockKey) -> Buffer | None:
        """The stored object of `key`, or None."""

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

    async def _namespaces(self) -> list[bytes]:
        """Every namespace with objects in this tier (default: only this one)."""
        return [self.namespace]

    async def _close(self) -> None:  # noqa: B027 - optional: most tiers hold something to release
        """Release connections, files and threads."""

    # -- the public API ---------------------------------------------------------------------------

    async def get(self, key: KeyLike, into: memoryview | bytearray) -> bool:
        """Read the block of `key` into `into` (exactly its size); whether it was found.

        A corrupt, truncated, foreign or wrongly sized object is a miss: it is counted under
        `corrupt.<reason>` and deleted unless the tier is read-only.
        """
        block = as_key(key)
        view = memoryview(into).cast("B")
        try:
            if self._reads_into and self.codec == "raw":
                raw = await self._call(cast(ReadsInto, self)._read_into(block, view))
                return await self._accept_into(block, raw, view)
            blob = await self._call(self._read(block))
        except Corrupt as e:
            await self._refuse(block, e)
            return False
        return await self._accept(block, blob, view)

    async def _accept_into(self, block: BlockKey, raw: Buffer | None, view: memoryview) -> bool:
        """Verify the header a `_read_into` returned, its payload already in `view` (or the
        whole object, when the backend could not place the payload)."""
        if raw is None:
            return self._miss()
        try:
            header = decode_header(raw, block, self.namespace)
            if len(raw) > header.payload_offset:  # the whole object: its payload was not placed
                return await self._accept(block, raw, view)
            if header.codec != "raw":
                raise Corrupt("codec", f"expected a raw object, found {header.codec}")
            self._check_length(header.raw_length, len(view))
            verify_payload(header, view[: header.stored_length])
        except Corrupt as e:
            await self._refuse(block, e)
            return False
        return self._hit(len(view))

    async def _accept(self, block: BlockKey, blob: Buffer | None, view: memoryview) -> bool:
        """Verify a stored object read by a backend and copy its block into `view`."""
        if blob is None:
            return self._miss()
        try:
            blob = memoryview(blob)
            header = decode_header(blob, block, self.namespace)
            payload = blob[header.payload_offset : header.object_length]
            verify_payload(header, payload)
            self._check_length(header.raw_length, len(view))
            view[:] = decompress(header.codec, payload, header.raw_length)
        except Corrupt as e:
            await self._refuse(block, e)
            return False
        return self._hit(len(view))

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

    async def read_object(self, key: KeyLike) -> bytes | None:
        """The stored object of `key` as it is (header and payload), unverified: for
        operators' tools that inspect or move objects."""
        blob = await self._call(self._read(as_key(key)))
        return None if blob is None else bytes(blob)

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
        except TierError:
            self.counters["errors"] += 1
            raise

    def _miss(self) -> bool:
        self.counters["misses"] += 1
        return False

    def _check_length(self, stored: int, wanted: int) -> None:
        if stored != wanted:
            raise Corrupt("truncated", f"block of {stored} bytes, the buffer holds {wanted}")

    async def _refuse(self, key: BlockKey, error: Corrupt) -> None:
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
