"""The operators' side of a tier: listings, usage, raw objects and their inspection, for
`kvtier` commands and metrics, never the data path (the event loop thread that owns the tier);
and its records (`tiering.tier.records`: small named objects beside the blocks, a manifest of
use, a record of reads), written and read off the data path too.

`OperatorCalls` is a part of `tiering.tier.Tier`, split off along this seam: what it calls is
the contract's (`tiering.tier.contract`), what it verifies with is the tier's envelope.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from tiering.errors import KeyFormatError, StateError, TierError, TierTimeout
from tiering.keys import BlockKey, key_from_hex
from tiering.tier.contract import TierContract
from tiering.tier.counters import FOREIGN_NAMES
from tiering.tier.envelope import Envelope
from tiering.tier.format import MAX_BLOCK_BYTES, Header
from tiering.tier.records import (
    MAX_LISTED_RECORDS,
    MAX_RECORD_BYTES,
    RECORD_NAME,
    check_record_name,
    record_key,
)
from tiering.tier.values import Buffer, KeyLike, NamespaceUsage, ObjectInfo, TierStat, as_key

__all__ = ["OperatorCalls"]


class OperatorCalls(TierContract):
    """The calls operators' commands and metrics make of a tier (the event loop thread that
    owns it). Keys may be given as `KeyLike`; an invalid one raises `KeyFormatError` before
    any I/O; a failure of the store raises a `TierError`."""

    envelope: Envelope
    """How the tier seals and opens its objects (`tiering.tier.envelope`)."""
    read_only: bool
    """Set by the tier (its `read_only` option): writes raise `StateError`."""

    async def write_record(self, name: str, data: Buffer | bytearray) -> bool:
        """Store `data` as record `name` (`tiering.tier.records`), sealed like a block under the
        record's key, replacing any; whether the tier keeps records. `StateError` on a
        read-only tier."""
        self._writable("write a record")
        parts = self.envelope.seal(record_key(name), data)
        blob = b"".join(parts)
        self.envelope.written(parts)
        return await self._call(self._write_record(name, blob))

    async def delete_record(self, name: str) -> bool:
        """Remove record `name`; whether it was there. `StateError` on a read-only tier."""
        self._writable("delete a record")
        return await self._call(self._delete_record(check_record_name(name)))

    async def read_record(self, name: str, limit: int = MAX_RECORD_BYTES) -> bytes | None:
        """Record `name`'s data, opened and verified, or None (none there, or a tier that keeps
        none); `CorruptObject` when the object is refused (damaged, of another namespace,
        name or secret, or larger than `limit`): a record is never deleted by its reader."""
        key = record_key(name)
        blob = await self._call(self._read_record(name, limit + self.header_room))
        if blob is None:
            return None
        return bytes(self.envelope.open(key, blob)[1])

    def _writable(self, what: str) -> None:
        if self.read_only:
            raise StateError(f"tier {self.name!r} is read-only: cannot {what}")

    def listed_key(self, name: bytes | str) -> BlockKey | None:
        """The key a stored name gives (a key's hex form, as kvtier writes names), or None,
        counted under `foreign_names`, for a name no kvtier wrote: anyone who can write to a
        shared store may put anything there, and one odd name must not stop a listing."""
        try:
            return key_from_hex(name.decode() if isinstance(name, bytes) else name)
        except (KeyFormatError, UnicodeDecodeError):
            self.counters[FOREIGN_NAMES] += 1
            return None

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
        (`tiering.tier.format.MAX_BLOCK_BYTES`) raises `CorruptObject("length")` unread."""
        return await self._call(self._read(as_key(key), self.object_limit(MAX_BLOCK_BYTES)))

    async def read_head(self, key: KeyLike) -> tuple[bytes, int] | None:
        """The first `header_room` bytes of the stored object of `key` (its header) and the
        object's real size, unverified; None when absent. For listings and inspection: it
        reads no payload."""
        got = await self._call(self._read_head(as_key(key), self.header_room))
        return None if got is None else (bytes(got[0]), got[1])

    def verified_block(self, key: BlockKey, blob: Buffer, size: int | None = None) -> Buffer:
        """The block a stored object holds, verified as a read would verify it (header, real
        size, checksum, MAC with a secret, bounded decoding); `size`: the block size expected.
        Raises `CorruptObject`."""
        return self.envelope.open(key, blob, size)[1]

    def decode_header(self, key: BlockKey, head: Buffer) -> Header:
        """The checked header of the object of `key` whose first bytes are `head`."""
        return self.envelope.header(key, head)

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

    async def list_records(
        self, prefix: str = "", limit: int = MAX_LISTED_RECORDS, timeout: float | None = None
    ) -> list[str]:
        """The names of this namespace's records (`tiering.tier.records`) that start with
        `prefix`, sorted: at most `limit` (a store holding more answers the first it meets),
        none from a tier that keeps no records. A name that is not a record's (planted by
        anyone who can write to the store) is left out. Bounded like `usage` by `timeout`, not
        the tier's per-block deadline; not counted among the tier's `errors`."""
        try:
            async with asyncio.timeout(timeout):
                names = await self._list_records(prefix, limit)
        except TimeoutError as e:
            if isinstance(e, TierError):
                raise
            raise TierTimeout(f"tier {self.name!r}: records not listed within {timeout:g}s") from e
        kept = {n for n in names if isinstance(n, str) and n.startswith(prefix)}
        return sorted(n for n in kept if RECORD_NAME.match(n))[:limit]
