"""The secondary-tier contract: the primitives a backend writes, and what it declares it can do.

A backend implements async primitives over *stored objects* (the bytes of `tiering.tier.format`:
header, then payload) and declares its capabilities in class attributes; `tiering.tier.Tier`
adds everything else (the envelope, deadlines, counting, batching, the public API):

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

Optional, with defaults here: `_read_head(key, n)` (a ranged read), `_read_record` and
`_write_record`, `_delete_record`, `_list_records` (small named objects beside the blocks,
`tiering.tier.records`), `_list()` and
`_entries()` (with `supports_listing = True`), `_namespaces()`, `_usage()`, `_delete_refused(key,
seen)`, `_close()`, `_knows(key)` and `newest(n)` (with `indexed = True`: an in-process index of
every object). Optional fast paths the base looks for are `Protocol`s: `ReadsInto` (the payload
read straight into the caller's buffer), `tiering.tier.batching.ReadsMany` and `WritesMany` (a
batch in one request, answered raw).

What the base class guarantees every primitive: keys are `BlockKey`s already validated (no path
or name comes from input); `limit` is the largest object the caller can use (`object_limit` of
its block size); a write or a delete never reaches a read-only tier; every call runs on the
event loop thread that owns the tier (the runtime's, or an operator command's `asyncio.run`),
under the tier's deadline, so it may be cancelled at any await; nothing a backend returns is
trusted: every object is verified by the base (`tiering.tier.envelope`) before a byte of it reaches
a caller's block.

What every primitive must do: never read or allocate more than `limit` bytes for one object (a
store holding a larger one answers `CorruptObject("length")` without reading it: a crafted 2 GiB
object costs a stat, not 2 GiB); raise `TierUnavailable`, `TierTimeout`, `TierFull` or
`TierError` (translated from its library's errors, `raise ... from e`) when the store fails;
answer None or False for a missing object, never an error; never block the event loop (blocking
libraries go to a bounded thread pool below it, `tiering.tier.threads.IOThreads`).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import ClassVar, Protocol, TypeVar, runtime_checkable

from tiering.errors import CorruptObject, StateError, TierError, TierTimeout
from tiering.keys import BlockKey
from tiering.tier.counters import ERRORS
from tiering.tier.format import MAX_BLOCK_BYTES
from tiering.tier.options import TierOptions
from tiering.tier.values import HEADER_ROOM, Buffer, Medium, NamespaceUsage, ObjectInfo, TierStat

__all__ = ["CAPABILITIES", "ReadsInto", "TierContract", "within"]

T = TypeVar("T")


async def within(operation: Awaitable[T], timeout: float | None, tier: str) -> T:
    """`operation`'s result, `TierTimeout` past `timeout` seconds (None: no deadline): a
    timeout becomes our own error, named for the tier, in this one place (the event loop thread
    that owns the tier). A `TierTimeout` the operation raised itself passes as it is."""
    try:
        if timeout is None:
            return await operation
        async with asyncio.timeout(timeout):
            return await operation
    except TimeoutError as e:
        if isinstance(e, TierError):
            raise
        raise TierTimeout(f"tier {tier!r}: no answer within {timeout:g}s") from e


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
    header, `tiering.tier.format.peek_lengths`, says a stored length of `len(payload)`), `data` then
    being exactly the first payload-offset bytes (the header); otherwise return the whole
    object as `data` (at most `limit` bytes) with `placed` false. The flag is what tells the two
    apart: an object cut at its payload offset is as long as a header. The caller verifies
    everything else (header, lengths, checksum, MAC) and treats `payload` as garbage unless it
    accepts the object.
    """

    async def _read_into(
        self, key: BlockKey, payload: memoryview, limit: int
    ) -> tuple[Buffer, bool] | None: ...


CAPABILITIES = (
    "type_name",
    "persistent",
    "shared",
    "medium",
    "supports_listing",
    "evicts",
    "align",
    "writes_once",
    "indexed",
)
"""The names of a tier's capabilities (`TierContract`'s attributes, documented there): the one
list a wrapper copies from the tier it wraps and the tests check."""


class TierContract(ABC):
    """The primitives of a secondary tier and its capabilities (the event loop thread that
    owns the tier; the capabilities may be read from any thread).

    Capabilities are attributes: a backend declares them in its class body, and a wrapper
    (`tiering.tier.wrappers.ForwardingTier`) takes the wrapped tier's on the instance.
    """

    type_name: str = ""
    """The name YAML's `type` gives this class (`tiering.registry`)."""
    persistent: bool = False
    """Objects survive the tier's process and a restart."""
    shared: bool = False
    """Several engines (hosts) can use the same tier at once."""
    medium: Medium = Medium.REMOTE
    """Where the tier keeps its blocks (`Medium`)."""
    supports_listing: bool = False
    """The tier can list its keys (`keys`, `entries`): the backend implements `_list`."""
    evicts: bool = False
    """The tier enforces `capacity` itself by evicting least recently used objects."""
    align: int = 1
    """Payload offset alignment in stored objects (a file tier with O_DIRECT uses 4096)."""
    writes_once: bool = False
    """This tier's puts leave an object already stored for the key in place (`_write` answers
    False): set by a backend, per instance, where its store allows it (Redis `SET NX`, an S3
    conditional put, an exclusive create)."""
    indexed: bool = False
    """The tier keeps an in-process index of the objects it holds, so `knows` answers without
    I/O and the tiering manager needs no existence checks while the tier is its store's only
    writer (while other processes write the store, `knows` may answer None for a key the index
    lacks: the manager then asks `contains`)."""
    Options: ClassVar[type[TierOptions]] = TierOptions
    """The record of the settings this class takes (YAML keys and constructor keywords)."""

    name: str
    """The tier's name in messages and metrics."""
    namespace: bytes
    """The namespace digest whose blocks the tier serves (`tiering.keys`)."""
    timeout: float | None
    """The deadline of every primitive's call, in seconds (None: none)."""
    counters: Counter[str]
    """Events by name (`tiering.tier.counters`)."""

    @property
    def header_room(self) -> int:
        """Bytes a stored object of this tier may take before its payload."""
        return max(HEADER_ROOM, self.align)

    def object_limit(self, block_bytes: int) -> int:
        """The largest stored object this tier can hold for a block of `block_bytes`: a header
        and its padding, and the block (a stored payload is never longer than its block)."""
        return self.header_room + block_bytes

    # -- how every primitive is called ----------------------------------------------------------

    async def _deadline(self, operation: Awaitable[T]) -> T:
        """`operation` under the tier's deadline (`within`), counting nothing:
        for batch primitives, whose errors the base counts per key."""
        return await within(operation, self.timeout, self.name)

    async def _call(self, operation: Awaitable[T]) -> T:
        """A primitive's call under the tier's deadline; a failure of the store (a timeout
        included) counts as an error and propagates, a corrupt object is the object's fault,
        counted where it is refused."""
        try:
            return await self._deadline(operation)
        except CorruptObject:
            raise
        except TierError:
            self.counters[ERRORS] += 1
            raise

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
        payload: `tiering.tier.format.encode`), to write without joining them where the store can.

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

    async def _delete_refused(self, key: BlockKey, seen: bytes | None) -> bool:
        """Remove the copy of `key` a read just refused as one that may go (`Tier._refuse`),
        only while it is the object read: `seen`, when the envelope refused it, is its first
        bytes as read (`CorruptObject.seen`), and a store that holds other bytes under the name
        now (a neighbour replaced it meanwhile) keeps them. Whether it was removed.

        Default: the object's head read again and compared, then `_delete` (not atomic: a
        backend whose store can, makes it one conditional operation: Redis compares and
        deletes in a script, S3 deletes `If-Match` the version compared). Override also where a
        key may have several copies (an S3 block in a pack and as a single object): only the
        one read may go."""
        if seen is not None:
            head = await self._read_head(key, len(seen))
            if head is None or bytes(head[0]) != seen:
                return False
        return await self._delete(key)

    async def _usage(self) -> list[NamespaceUsage]:
        """What every namespace holds in the tier's store, store-wide (every engine's objects
        at the tier's location: its directory, key prefix or bucket prefix). Default: this
        namespace, from `_stat`, without a write time. Override where the store can tell
        (listings with sizes and times).

        The implementation must: list only namespaces that hold objects, each object once
        (`objects` counts block objects: a pack's blocks, a segment's records); keep its memory
        bounded whatever the store holds (stream the listing; `tiering.tier.usage.UsageTally`
        bounds the namespaces); be cancellable (a deadline), leaving no thread of its working
        on past it for long.
        The implementation may: take time proportional to the store's objects (it is for
        operators and the usage metrics, never the data path)."""
        stat = await self._stat()
        if not stat.objects:
            return []
        return [NamespaceUsage(self.namespace, stat.objects, stat.bytes_used)]

    async def _read_record(self, name: str, limit: int) -> Buffer | None:
        """The stored object of record `name` (`tiering.tier.records`) of this namespace, as
        `_write_record` got it, or None (none there, or a tier that keeps no records: the
        default).

        Guaranteed by the caller: `name` is a record's (`check_record_name`).
        The implementation must: raise `CorruptObject("length")` for an object larger than
        `limit` without reading it; keep records apart from blocks (never listed, counted,
        evicted or indexed as one)."""
        return None

    async def _write_record(self, name: str, blob: bytes) -> bool:
        """Store `blob` as record `name` of this namespace, replacing any (never write-once),
        atomic for readers: a reader sees the old record or the new one, and a process killed
        in the middle leaves the old one. Whether the tier keeps records (default: False,
        nothing written).

        Guaranteed by the caller: the tier is not read-only; `name` is a record's."""
        return False

    async def _delete_record(self, name: str) -> bool:
        """Remove record `name` of this namespace; whether one was there (default: False).

        Guaranteed by the caller: the tier is not read-only; `name` is a record's."""
        return False

    async def _list_records(self, prefix: str, limit: int) -> list[str]:
        """The names of this namespace's records that start with `prefix`, at most `limit`
        (default: none). The caller checks every name and sorts them.

        The implementation must: keep its memory and requests bounded by `limit` (pages of
        `tiering.tier.records.RECORD_PAGE`, stopping at `limit` names), never answer a block's
        name, nor a record of another namespace."""
        return []

    async def _close(self) -> None:  # noqa: B027 - optional: most tiers hold something to release
        """Release connections, files and threads; called once, by the first `close`. The
        implementation must: first write out any object it still holds only in memory (the S3
        tier's blocks waiting for a pack)."""

    def _knows(self, key: BlockKey) -> bool | None:
        """Whether an `indexed` tier's index holds `key` (no I/O, any thread: one dict lookup,
        atomic under the GIL); None when it cannot say without asking its store (not
        `indexed`, or a key its index lacks while other processes write its store). The base's
        `knows` answers this, and no for a key refused moments ago."""
        return None

    def newest(self, n: int) -> list[BlockKey]:
        """Up to `n` of the keys an `indexed` tier holds, the most recently written or read
        first, from its index (no I/O; the runtime's thread, like the primitives, or any
        thread before the tier's first call): what a warm start reads into the primary
        (`primary.warm_start`). A tier without an index answers none."""
        return []
