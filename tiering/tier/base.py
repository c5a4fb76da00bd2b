"""The secondary tier's base class, `Tier`: the public data path over a backend's primitives.

A backend writes the primitives of `tiering.tier.contract` and declares its capabilities there;
`Tier` adds everything else, each concern in its own module:

- the object envelope (`tiering.tier.envelope`): every block sealed into a stored object on `put`,
  every object read back opened and verified before a byte of it reaches a caller's block;
- deadlines and error translation (`tiering.tier.contract`, `TierContract._call`);
- batches (`tiering.tier.batching`): bounded concurrency, and a backend's optional batch primitives,
  whose raw answers the base verifies, counts and refuses as a single call's;
- counters (`tiering.tier.counters`): the names of every event counted;
- the operators' API (`tiering.tier.operators`): listings, usage, raw objects;
- names refused moments ago, a fast miss (`tiering.tier.refusals`);
- read-only mode, authenticated objects (`secret`) and the async context manager, here.

A backend imports all of it from the package (`from tiering.tier import Tier, TierStat, ...`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, TypeVar, cast

from tiering.errors import ConfigError, CorruptObject, TierError
from tiering.keys import NAMESPACE_BYTES, BlockKey, owns_namespace
from tiering.tier.batching import RawRead, RawWrite, ReadsMany, WritesMany, bounded
from tiering.tier.contract import ReadsInto
from tiering.tier.counters import (
    BYTES_READ,
    BYTES_WRITTEN,
    DELETES,
    DUPLICATE_BYTES,
    DUPLICATES,
    ERRORS,
    HITS,
    HITS_OTHER_WRITER,
    MISSES,
    PUTS,
    REFUSED_SKIPS,
    corrupt,
)
from tiering.tier.envelope import Envelope, seal_threshold, sealing_threads
from tiering.tier.format import REMOVABLE, Header
from tiering.tier.operators import OperatorCalls
from tiering.tier.options import TierOptions
from tiering.tier.refusals import RecentRefusals
from tiering.tier.values import (
    Buffer,
    KeyLike,
    as_key,
)

__all__ = ["Tier"]

log = logging.getLogger("tiering.tier")  # the package's name: the one operators filter on

T = TypeVar("T")


class Tier(OperatorCalls):
    """Base of every secondary tier: built in the scheduler process (or by an operator's
    `kvtier` command); every call runs on one event loop thread, the runtime's (`knows` and
    the attributes may be read from any thread).

    See `tiering.tier.contract` for what a backend writes and what it may rely on. Subclasses
    declare their settings as an options record (`Options`, a subclass of their parent's), and
    their capabilities as the contract's attributes.
    """

    options: TierOptions
    """This tier's settings, read by `Options.of` from the constructor's keywords."""
    seal_in_threads: int = seal_threshold()
    """The block size from which a tier with a secret seals and opens on the sealing threads
    (`tiering.tier.envelope.seal_threshold`: `SEAL_IN_THREADS` with cores to spare, else
    never; `bench/auth.py --seal-in-threads` compares)."""

    def __init__(
        self,
        *,
        namespace: bytes,
        secret: bytes | None = None,
        encrypt: bool = False,
        name: str | None = None,
        options: TierOptions | None = None,
        **values: Any,
    ) -> None:
        """`namespace`: the store namespace whose blocks this tier serves (`tiering.keys`: an
        engine's is its layout's under its secret, `store_namespace`); `secret`: the
        deployment's secret for authenticated objects (at least `MIN_SECRET_BYTES`): every
        object is written sealed (`tiering.tier.sealing`), and one without a valid seal is a
        miss; `encrypt`: payloads are encrypted too (`auth.encrypt`); `name`: the tier's
        name in messages and metrics (default: `type_name`); `options`: the tier's settings as
        the record the configuration checked (an `Options`, `tiering.config.tier_from_config`),
        and/or `values`: settings of `Options` as Python values (bytes, seconds) or YAML ones
        (`8GiB`, `200ms`), in place of the record's. Raises `ConfigError` naming the option
        that is unknown or wrong."""
        if len(namespace) != NAMESPACE_BYTES:
            raise ConfigError(f"namespace: expected {NAMESPACE_BYTES} bytes, got {len(namespace)}")
        if options is None:
            self.options = self.Options.of(values)
        elif type(options) is not self.Options:
            raise ConfigError(
                f"options: a {type(self).__name__} takes a {self.Options.__name__} record, "
                f"got a {type(options).__name__}"
            )
        else:
            self.options = options.with_values(values)
        self.envelope = Envelope.of(
            namespace,
            secret=secret,
            encrypt=encrypt,
            codec=self.options.codec,
            checksum=self.options.checksum,
            align=self.align,
        )
        self.namespace = namespace
        self.names_owned = owns_namespace(namespace, secret)
        """Whether `namespace` is a store namespace of this tier's secret (`tiering.keys`): no
        one without the secret writes its names in good faith, so an object there without a
        valid MAC is a forgery, which the tier may remove (`removable`)."""
        self.name = name or self.type_name
        self.capacity = self.options.capacity
        self.codec = self.options.codec
        self.checksum = self.options.checksum
        self.read_only = self.options.read_only
        self.concurrency = self.options.concurrency
        self.timeout = self.options.timeout
        # once: a runtime_checkable isinstance walks the protocol's members, too slow for
        # every get
        self._reads_into = isinstance(self, ReadsInto)
        self._reads_many = isinstance(self, ReadsMany)
        self._writes_many = isinstance(self, WritesMany)
        self.counters: Counter[str] = Counter()
        """Events by name (`tiering.tier.counters`): hits, misses, puts, deletes, bytes_read,
        bytes_written, errors, corrupt.<reason> (`tiering.tier.format.REASONS`), evictions,
        duplicates and duplicate_bytes, hits_other_writer, foreign_names, refused_skips."""
        self.refused = RecentRefusals()
        """Names refused and left in place moments ago: lookups answer no without reading."""
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

    @property
    def writer(self) -> bytes:
        """This tier's id in the writer tag of every object it writes: a hit on an object
        another id wrote is counted under `hits_other_writer`."""
        return self.envelope.writer

    @property
    def authenticated(self) -> bool:
        """Whether objects are written with, and required to carry, a seal (`secret`)."""
        return self.envelope.authenticated

    def use_secret_of(self, other: Tier) -> None:
        """Verify and sign with `other`'s secret from now on (a wrapper without its own), in
        names that are that secret's when `other`'s are."""
        self.envelope = self.envelope.sealed_by(other.envelope)
        self.names_owned = other.names_owned

    # -- the data path ----------------------------------------------------------------------------
    # Called by the manager's jobs on the runtime thread. A failure of the store raises a
    # `TierError` (`TierTimeout` past the deadline); a corrupt object is a miss, never an error.

    async def get(self, key: KeyLike, into: memoryview | bytearray) -> bool:
        """Read the block of `key` into `into` (exactly its size); whether it was found.

        A corrupt, truncated, foreign, unauthenticated or wrongly sized object is a miss: it is
        counted under `corrupt.<reason>` and, when the damage is provable
        (`tiering.tier.format.REMOVABLE`), deleted unless the tier is read-only. After a miss `into`
        holds no block (it may hold garbage: a caller uses it only after a hit).
        """
        block = as_key(key)
        if self.refused and self.refused.fresh(block):
            self.counters[REFUSED_SKIPS] += 1
            return self._miss()
        view = memoryview(into).cast("B")
        limit = self.object_limit(len(view))
        try:
            if self._reads_into and self.codec == "raw":
                raw = await self._call(cast(ReadsInto, self)._read_into(block, view, limit))
                found = await self._accept_into(block, raw, view)
            else:
                blob = await self._call(self._read(block, limit))
                found = await self._accept(block, blob, view)
        except CorruptObject as e:
            await self._refuse(block, e)
            return False
        if found:
            self._served(block)
        return found

    def _served(self, key: BlockKey) -> None:
        """`get` served the block of `key` (a verified hit): a backend that keeps what was
        read (the S3 tier's record of reads, `tiers.s3.reads`) notes it. Nothing here."""

    async def get_bytes(self, key: KeyLike, size: int) -> bytes | None:
        """The block of `key` (of `size` bytes) as bytes, or None: `get` for callers without a
        buffer of their own."""
        out = bytearray(size)
        return bytes(out) if await self.get(key, out) else None

    async def put(self, key: KeyLike, data: Buffer | bytearray) -> None:
        """Store `data` as the block of `key`, replacing any; `StateError` on a read-only tier.
        `data` must stay unchanged until the call returns (it is written from where it lies)."""
        block, parts = await self._seal(key, data)
        written = await self._call(self._write(block, parts))
        self.envelope.written(parts)
        self._count_put(written, len(data))

    async def delete(self, key: KeyLike) -> bool:
        """Remove the block of `key`; whether there was one. `StateError` on a read-only tier."""
        block = as_key(key)
        self._writable("delete")
        found = await self._call(self._delete(block))
        self.counters[DELETES] += found
        return found

    async def contains(self, keys: Sequence[KeyLike]) -> list[bool]:
        """Whether each key has a block (existence only: a corrupt object is found by `get`;
        one refused moments ago is not asked for: no)."""
        blocks = [as_key(k) for k in keys]
        if self.refused:
            skipped = [self.refused.fresh(b) for b in blocks]
            if any(skipped):
                self.counters[REFUSED_SKIPS] += sum(skipped)
                asked = [b for b, skip in zip(blocks, skipped, strict=True) if not skip]
                answers = iter(await self.contains(asked))
                return [False if skip else next(answers) for skip in skipped]
        return await self._call(self._contains(blocks)) if blocks else []

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
        """`get` for each (key, buffer), a failure returned in its place, not raised: in the
        backend's batch read (`ReadsMany`) where it offers one, else at most `concurrency` at a
        time. Each answer is verified, counted and refused as `get`'s."""
        if self.refused:
            skipped = [self.refused.fresh(as_key(k)) for k, _ in items]
            if any(skipped):
                self.counters[REFUSED_SKIPS] += sum(skipped)
                self.counters[MISSES] += sum(skipped)
                asked = [item for item, skip in zip(items, skipped, strict=True) if not skip]
                read = iter(await self.get_many(asked))
                return [False if skip else next(read) for skip in skipped]
        if self._reads_many and items:
            blocks = [as_key(k) for k, _ in items]
            views = [memoryview(buffer).cast("B") for _, buffer in items]
            limits = [self.object_limit(len(view)) for view in views]
            try:
                answers = await cast(ReadsMany, self)._read_many(blocks, views, limits)
            except TierError as e:
                answers = [e] * len(blocks)
            if answers is not None:
                return [
                    await self._settle(block, answer, view)
                    for block, answer, view in zip(blocks, answers, views, strict=True)
                ]
        return await self._bounded([self.get(k, b) for k, b in items])

    async def put_many(
        self, items: Sequence[tuple[KeyLike, Buffer | bytearray]]
    ) -> list[None | BaseException]:
        """`put` for each (key, data), a failure returned in its place, not raised: in the
        backend's batch write (`WritesMany`) where it offers one, else at most `concurrency`
        at a time. Each object is encoded and counted as `put`'s."""
        if not self._writes_many or not items or self.read_only:
            return await self._bounded([self.put(k, d) for k, d in items])
        objects = await asyncio.gather(*(self._seal(k, d) for k, d in items))
        try:
            outcomes = await cast(WritesMany, self)._write_many(objects)
        except TierError as e:
            outcomes = [e] * len(objects)
        if outcomes is None:
            sizes = [len(data) for _, data in items]
            return await self._bounded(
                [self._put_encoded(b, p, n) for (b, p), n in zip(objects, sizes, strict=True)]
            )
        for outcome, (_, parts) in zip(outcomes, objects, strict=True):
            if not isinstance(outcome, BaseException):
                self.envelope.written(parts)
        return [self._stored(o, len(d)) for o, (_, d) in zip(outcomes, items, strict=True)]

    async def delete_many(self, keys: Sequence[KeyLike]) -> list[bool | BaseException]:
        """`delete` for each key, at most `concurrency` at a time; failures in their place."""
        return await self._bounded([self.delete(k) for k in keys])

    async def _bounded(self, calls: Sequence[Awaitable[T]]) -> list[T | BaseException]:
        return await bounded(calls, self.concurrency)

    async def _settle(
        self, block: BlockKey, got: RawRead, view: memoryview
    ) -> bool | BaseException:
        """One key of a batch read as `get` would answer it: an object refused (unread, or by
        the envelope in the backend's thread), an error counted and returned in its place, a
        hit the envelope opened, an answer verified as `_read_into`'s."""
        if isinstance(got, CorruptObject):
            await self._refuse(block, got)
            return False
        if isinstance(got, BaseException):
            self.counters[ERRORS] += 1
            return got
        if isinstance(got, Header):  # placed and opened by the envelope in the backend's thread
            return self._hit(len(view), got)
        return await self._accept_into(block, got, view)

    def _stored(self, outcome: RawWrite, size: int) -> None | BaseException:
        """One object of a batch write as `put` would count it; an error in its place."""
        if isinstance(outcome, BaseException):
            self.counters[ERRORS] += 1
            return outcome
        self._count_put(outcome, size)
        return None

    # -- verifying, counting, refusing ------------------------------------------------------------

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
            if self._in_threads(len(view)):
                header = await sealing_threads().run_to_end(
                    self.envelope.open_placed, block, data, view
                )
            else:
                header = self.envelope.open_placed(block, data, view)
        except CorruptObject as e:
            await self._refuse(block, e)
            return False
        return self._hit(len(view), header)

    async def _accept(self, block: BlockKey, blob: Buffer | None, view: memoryview) -> bool:
        """Verify a stored object read by a backend and copy its block into `view`."""
        if blob is None:
            return self._miss()
        try:
            if self._in_threads(len(view)):
                header = await sealing_threads().run_to_end(
                    self.envelope.open_into, block, blob, view
                )
            else:
                header = self.envelope.open_into(block, blob, view)
        except CorruptObject as e:
            await self._refuse(block, e)
            return False
        return self._hit(len(view), header)

    def _hit(self, size: int, header: Header) -> bool:
        """Count a verified hit of `size` bytes on the object of `header`."""
        self.counters[HITS] += 1
        self.counters[BYTES_READ] += size
        if header.writer is not None and header.writer != self.envelope.writer:
            self.counters[HITS_OTHER_WRITER] += 1
        return True

    def _miss(self) -> bool:
        self.counters[MISSES] += 1
        return False

    def _encode(
        self, key: KeyLike, data: Buffer | bytearray
    ) -> tuple[BlockKey, tuple[Buffer, Buffer]]:
        """The validated key and the object's parts (header, payload) for block `data`, as
        `put` writes them; `StateError` on a read-only tier."""
        block = as_key(key)
        self._writable("put")
        if self.refused:  # (most tiers hold none: no dict call per put)
            self.refused.forget(block)
        return block, self.envelope.seal(block, data)

    async def _seal(
        self, key: KeyLike, data: Buffer | bytearray
    ) -> tuple[BlockKey, tuple[Buffer, Buffer]]:
        """`_encode`, on the sealing threads when the block is large and sealed
        (`_in_threads`)."""
        if not self._in_threads(len(data)):
            return self._encode(key, data)
        return await sealing_threads().run_to_end(self._encode, key, data)

    def _in_threads(self, size: int) -> bool:
        """Whether a block of `size` bytes is sealed and opened on the sealing threads, off
        the event loop: with a secret, from `seal_in_threads` bytes (below, the hand-over costs
        more than the cryptography)."""
        return size >= self.seal_in_threads and self.envelope.authenticated

    async def _put_encoded(self, block: BlockKey, parts: Sequence[Buffer], size: int) -> None:
        written = await self._call(self._write(block, parts))
        self.envelope.written(parts)
        self._count_put(written, size)

    def _count_put(self, written: bool | None, size: int) -> None:
        """Count a put of a `size`-byte block that `_write` answered `written` for (False:
        the store held the key already)."""
        self.counters[PUTS] += 1
        if written is False:
            self.counters[DUPLICATES] += 1
            self.counters[DUPLICATE_BYTES] += size
        else:
            self.counters[BYTES_WRITTEN] += size

    def removable(self, error: CorruptObject) -> bool:
        """Whether an object refused for `error` may be removed by a writer: damage any reader
        can prove (`tiering.tier.format.REMOVABLE`), or, in a store namespace of this tier's secret
        (`names_owned`), an object without a valid MAC, which only a forger puts there. An
        object of another namespace or format, or without a valid MAC in names not this
        secret's, may be a neighbour's: left in place."""
        return error.reason in REMOVABLE or (error.reason == "auth" and self.names_owned)

    async def _refuse(self, key: BlockKey, error: CorruptObject) -> None:
        """Count `error` as a corrupt miss of `key` and, when the object may go (`removable`)
        and the tier is writable, remove it while the store still holds what was read
        (`_delete_refused`). An object left in place (not removable, or the store holding other
        bytes than were read) makes `key` a fast miss for a while (`refused`), and unknown to
        the tier's index (`knows`)."""
        self.counters[MISSES] += 1
        self.counters[corrupt(error.reason)] += 1
        removable = self.removable(error) and not self.read_only
        log.warning(
            "tier %r: object %s refused (%s)%s",
            self.name,
            key.hex(),
            error,
            "" if removable else "; left in place",
        )
        if not removable:
            self.refused.note(key)
            return
        try:
            removed = await self._call(self._delete_refused(key, error.seen))
        except TierError as e:
            log.warning("tier %r: cannot delete refused object %s: %s", self.name, key.hex(), e)
            self.refused.note(key)
            return
        if not removed:  # the store holds other bytes than were read: damaged on the way here
            self.refused.note(key)  # (or rewritten since): not read again for a while

    def knows(self, key: BlockKey) -> bool | None:
        """Whether an `indexed` tier holds `key`, from its index (`_knows`): no I/O, callable
        from any thread. No for a key refused moments ago (`refused_now`: the manager then
        promotes it from another tier); None when the tier cannot say without asking its store
        (not `indexed`, or a key its index lacks while other processes write its store): use
        `contains`."""
        known = self._knows(key)
        return False if known and self.refused_now(key) else known

    def refused_now(self, key: BlockKey) -> bool:
        """Whether `key` was refused and left in place moments ago (any thread: an index's
        `knows` answers no for it, so the manager promotes it from another tier)."""
        return bool(self.refused) and self.refused.holds(key)
