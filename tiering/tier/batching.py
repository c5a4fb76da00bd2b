"""Batches of tier calls: bounded concurrency for calls made one key at a time, and the optional
batch primitives a backend offers instead (on the event loop thread that owns the tier).

A backend whose store takes a batch in one request (a pipeline, a group of reads in one thread
hop) implements `ReadsMany` and `WritesMany`. They answer *raw*: what the store gave for each
key, unverified, or the error in its place. `Tier.get_many` and `Tier.put_many` do the rest, as
`get` and `put` do for one key: they encode every object, verify every answer with the tier's
envelope, refuse and count. A backend's batch primitive never counts or refuses anything itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine, Sequence
from typing import Protocol, TypeVar, runtime_checkable

from tiering.keys import BlockKey
from tiering.tier.format import Header
from tiering.tier.values import Buffer

__all__ = ["RawRead", "RawWrite", "ReadsMany", "WritesMany", "bounded"]

T = TypeVar("T")

RawRead = tuple[Buffer, bool] | Header | None | BaseException
"""One key of a batch read as a backend answers it: what `ReadsInto._read_into` answers (the
object, or its header with the payload placed in the key's buffer), None for no object, or the
error in its place (a `CorruptObject` for an object refused unread: too large, not a value). A
backend that reads in its own threads may open a placed payload there with the tier's envelope
(`Envelope.open_placed`, so that the checks of one read overlap the others) and answer the
`Header` it returned, or the `CorruptObject` it raised: the envelope verifies, the base counts
and refuses, as for any other answer."""
RawWrite = bool | None | BaseException
"""One object of a batch write as a backend answers it: what `_write` answers (False: the store
held the key already, nothing written), or the error in its place."""


@runtime_checkable
class ReadsMany(Protocol):
    """Optional batch read (runtime thread, like every primitive).

    Parameters: `keys`, the blocks' keys; `payloads`, each key's buffer (exactly its block's
    size, a writable byte view); `limits`, the largest object each caller can use.
    Returns: one `RawRead` per key, in order; or None when this batch has no fast path here (too
    small, a compressed codec): the base then reads it key by key.

    Guaranteed by the caller: what `ReadsInto._read_into` is guaranteed for each key; `keys` is
    not empty.
    The implementation must: answer for each key what `_read_into` would (placing a payload
    only under its rules); bound its requests with the tier's deadline (`Tier._deadline`, which
    does not count); never count or refuse, and verify nothing but through the tier's envelope
    (`RawRead`): the base counts and refuses, for every answer. A failure of the whole batch
    may be raised (a `TierError`: each key answers it), never a `CorruptObject`, which is one
    object's.
    """

    async def _read_many(
        self, keys: Sequence[BlockKey], payloads: Sequence[memoryview], limits: Sequence[int]
    ) -> list[RawRead] | None: ...


@runtime_checkable
class WritesMany(Protocol):
    """Optional batch write (runtime thread, like every primitive).

    Parameters: `objects`, each key with its object's parts (header, payload), encoded by the
    base. Returns: one `RawWrite` per object, in order; or None when this batch has no fast
    path here (the base then writes it object by object).

    Guaranteed by the caller: what `_write` is guaranteed for each object; `objects` is not
    empty.
    The implementation must: store each object as `_write` would (an object larger than a
    tier's capacity fails alone, `TierFull`); bound its requests with the tier's deadline
    (`Tier._deadline`); never count: the base counts every answer.
    """

    async def _write_many(
        self, objects: Sequence[tuple[BlockKey, Sequence[Buffer]]]
    ) -> list[RawWrite] | None: ...


async def bounded(calls: Sequence[Awaitable[T]], concurrency: int) -> list[T | BaseException]:
    """Every one of `calls`, at most `concurrency` at a time, each result or failure in its
    place; a call still queued when the batch is cancelled never starts."""
    gate = asyncio.Semaphore(concurrency)

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
