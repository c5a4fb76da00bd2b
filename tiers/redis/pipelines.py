"""The Redis tier's batches: pipelines of GETs and SET NXs, answered raw for the base to verify
and count (`tiering.tier.batching`), on the runtime's loop thread like the tier.

A batch goes in one pipeline, or for large blocks on the fast path one per `PIPELINE_BYTES` of
values, at most `streams` of them at once on as many connections. Pipelines read their replies
one by one, so an error reply fails its own command only and the others' values arrive; a
pipeline that fails fails its own blocks only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

from tiering.errors import CorruptObject, TierError
from tiering.keys import BlockKey
from tiering.tier import Buffer
from tiering.tier.batching import RawRead, RawWrite
from tiers.redis.errors import RedisErrors, empty, replies, within
from tiers.redis.resp import ReplyError, RespConnection, command, set_command
from tiers.redis.resp_pool import RespPool

__all__ = ["DRAIN", "PIPELINE_BYTES", "PIPELINE_MAX_VALUE", "Pipelines"]

T = TypeVar("T")

DRAIN = 1 << 20
"""In a pipeline, a value too large for its block is dropped through the connection's buffer
when it is at most this long (the later replies stay readable on the same connection); a longer
one costs the connection instead, and the GETs after it are sent again on another: cheaper
than moving hundreds of MiB only to drop them."""
PIPELINE_MAX_VALUE = 512 << 10
"""The largest value a redis-py batch of SETs sends in a pipeline; a batch with a larger one
goes as concurrent SETs (a pipeline packs and sends large values one after another on one
connection, concurrent SETs spread them over connections: BENCHMARKS.md, "Measurements behind
design choices")."""
PIPELINE_BYTES = 1 << 20
"""Value bytes per pipeline of a batch on the fast path: a batch of large blocks goes as several
pipelines, at most `streams` of them at once on as many connections; one connection carries its
replies one after another (BENCHMARKS.md, "Measurements behind design choices")."""


class Deadline(Protocol):
    """The tier's deadline around a call, counting nothing (`Tier._deadline`)."""

    def __call__(self, operation: Awaitable[T], /) -> Awaitable[T]: ...


class Pipelines:
    """The batches of one Redis tier (the runtime's loop thread): through the fast path's
    `RespPool` where the tier has one, else through redis-py's pipelines."""

    def __init__(
        self,
        *,
        client: Any,
        fast: RespPool | None,
        name: Callable[[BlockKey], bytes],
        errors: RedisErrors,
        deadline: Deadline,
        px: int | None,
        streams: int,
    ) -> None:
        """`client`: the tier's redis-py client; `fast`: its fast path's pool, or None; `name`:
        a block's Redis key; `errors`: its error translation; `deadline`: its deadline; `px`:
        the expiry of each SET in milliseconds (None: none); `streams`: pipelines at once."""
        self._client = client
        self._fast = fast
        self._name = name
        self._errors = errors
        self._deadline = deadline
        self._px = px
        self._streams = streams

    async def read(
        self,
        keys: Sequence[BlockKey],
        payloads: Sequence[memoryview],
        limits: Sequence[int],
        *,
        into: bool,
    ) -> list[RawRead]:
        """GETs of `keys`, each answer as `_read_into`'s (a key that holds no string, or a
        value too large, refused unread: a `CorruptObject` in its place); with `into` (a raw
        codec) on the fast path, each value read straight into its payload buffer."""
        if self._fast is not None and into:
            spans = _spans([len(view) for view in payloads], PIPELINE_BYTES)
            answers: list[RawRead] = []
            gate = asyncio.Semaphore(self._streams)
            pipelines = (self._fetch(keys[s], payloads[s], limits[s], gate) for s in spans)
            for got in await _each(pipelines):
                answers += got
            return answers
        names = [self._name(key) for key in keys]
        what = "GET (pipelined)"

        async def fetch() -> list[Any]:
            with self._errors.around(what):
                pipe = self._client.pipeline(transaction=False)
                for name, limit in zip(names, limits, strict=True):
                    pipe.getrange(name, 0, limit)
                heads = replies(await pipe.execute(raise_on_error=False))
                blank = [i for i, head in enumerate(heads) if head == b""]
                if blank:
                    pipe = self._client.pipeline(transaction=False)
                    for i in blank:
                        pipe.exists(names[i]).strlen(names[i])
                    got = replies(await pipe.execute(raise_on_error=False))
                    for n, i in enumerate(blank):
                        heads[i] = empty(got[2 * n : 2 * n + 2])
            return heads

        heads = await self._deadline(fetch())
        answers = []
        for head, limit in zip(heads, limits, strict=True):
            if isinstance(head, Exception):
                answers.append(self._errors.reply(head, what))
                continue
            try:
                answers.append(None if head is None else (within(head, limit), False))
            except CorruptObject as e:
                answers.append(e)
        return answers

    async def write(
        self, objects: Sequence[tuple[BlockKey, Sequence[Buffer]]]
    ) -> list[RawWrite] | None:
        """SET NX of each object (False: the key was there); None for a batch of large values
        without the fast path (`PIPELINE_MAX_VALUE`: the base sends them as concurrent SETs)."""
        if self._fast is not None:
            spans = _spans([len(parts[1]) for _, parts in objects], PIPELINE_BYTES)
            stored: list[RawWrite] = []
            gate = asyncio.Semaphore(self._streams)
            for got in await _each(self._store(objects[s], gate) for s in spans):
                stored += got
            return stored
        if max(len(parts[1]) for _, parts in objects) > PIPELINE_MAX_VALUE:
            return None
        what = "SET (pipelined)"

        async def store() -> list[Any]:
            with self._errors.around(what):
                pipe = self._client.pipeline(transaction=False)
                for key, parts in objects:
                    pipe.set(self._name(key), b"".join(parts), px=self._px, nx=True)
                return replies(await pipe.execute(raise_on_error=False))

        answers = await self._deadline(store())
        return [
            self._errors.reply(r, what, of_a_read=False) if isinstance(r, Exception) else bool(r)
            for r in answers
        ]

    async def _fetch(
        self,
        keys: Sequence[BlockKey],
        views: Sequence[memoryview],
        limits: Sequence[int],
        gate: asyncio.Semaphore,
    ) -> list[RawRead]:
        """One pipeline of GETs, each value read into its view. An error reply (WRONGTYPE)
        answers its own GET only: the replies after it are the next GETs'. A value far too
        large for its block leaves the connection out of step (`DRAIN`): the GETs after it are
        sent again on another connection, so each block still gets its own answer."""
        assert self._fast is not None
        fast = self._fast
        got: list[RawRead] = []
        what = "GET (pipelined)"
        views, limits = list(views), list(limits)

        async def exchange(conn: RespConnection) -> None:
            start = len(got)  # a retry, or the rest after a connection given up, goes on
            await conn.send([command(b"GET", self._name(key)) for key in keys[start:]])
            while len(got) < len(views):
                # the common replies in bulk, by the compiled reader; then one the slow way
                got.extend(await conn.values_into(views[len(got) :], limits[len(got) :]))
                if len(got) == len(views):
                    return
                view = views[len(got)]
                try:
                    got.append(await conn.value_into(view, limits[len(got)], DRAIN))
                except ReplyError as e:
                    got.append(self._errors.reply(e, what))
                except CorruptObject as e:
                    got.append(e)
                    if conn.broken:
                        return

        async def fetch() -> None:  # the wait at `gate` too is under the deadline
            async with gate:
                with self._errors.around(what):
                    while len(got) < len(keys):
                        await fast.run(exchange)

        try:
            await self._deadline(fetch())
        except TierError as e:
            got += [e] * (len(keys) - len(got))
        return got

    async def _store(
        self, objects: Sequence[tuple[BlockKey, Sequence[Buffer]]], gate: asyncio.Semaphore
    ) -> list[RawWrite]:
        assert self._fast is not None
        fast = self._fast
        px = self._px
        parts: list[Buffer] = []
        for key, value in objects:
            parts += set_command(self._name(key), value, px, nx=True)

        async def exchange(conn: RespConnection) -> list[RawWrite]:
            await conn.send(parts)
            outcomes: list[RawWrite] = []
            for _ in objects:
                try:
                    outcomes.append(await conn.reply() is not None)  # nil: the key was there
                except ReplyError as e:  # the stream stays in step after an error reply
                    outcomes.append(self._errors.reply(e, "SET", of_a_read=False))
            return outcomes

        async def store() -> list[RawWrite]:  # the wait at `gate` is under it too
            async with gate:
                with self._errors.around("SET (pipelined)"):
                    return await fast.run(exchange)

        try:
            return await self._deadline(store())
        except TierError as e:
            return [e] * len(objects)


def _spans(sizes: list[int], limit: int) -> list[slice]:
    """Consecutive slices of `sizes` of at most `limit` bytes each (at least one item)."""
    spans: list[slice] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > limit:
            spans.append(slice(start, i))
            start, total = i, 0
        total += size
    spans.append(slice(start, len(sizes)))
    return spans


async def _each(calls: Iterable[Awaitable[T]]) -> list[T]:
    """The results of `calls`, run at once (one call runs without a task); an exception is
    raised only once every call has ended (they read into the caller's buffers)."""
    pending = list(calls)
    if len(pending) == 1:
        return [await pending[0]]
    results = await asyncio.gather(*pending, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]
