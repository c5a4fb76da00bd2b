"""The Redis tier: blocks as Redis strings, one server or a Redis Cluster.

(Over 400 lines: a third of it is the pipelined batches, on two transports; they share the
single-key paths' error translation and verification helpers, and splitting them off would put
one class's private protocol across two modules. The wire protocol itself is `tiers.resp`.)

Keys are `kvtier:<namespace hex>:<key hex>`, so several models share a server without seeing
each other's blocks and `kvtier ls` can scan one namespace. Batches (`contains`, `get_many`,
`put_many`) go in pipelines: one per batch, or for large blocks one per `PIPELINE_BYTES` of
values, on as many connections at once.

Blocks move through `tiers.resp` on a plain-TCP server: a GET lands in the primary slot with no
intermediate copy and a SET sends header and payload from where they lie (redis-py copies a
value two or three times on the way). TLS and Cluster go through redis-py (`redis.asyncio`,
which packs large values faster than hiredis's packer), as do the other
commands. Connection errors become `TierUnavailable`; the tier's deadline bounds every call.

Every write is `SET NX` (with `EX` when `ttl` is set, in the same command), on every path: of
engines writing one block at once, one writes it and the others' SETs answer nil, counted as
`duplicates` (nothing sent twice is stored twice, and no engine replaces an object it cannot
read: another secret's stays). A damaged object is deleted by the reader that refuses it, so
the next write lands. A SET the server refuses because it is full (an OOM reply:
`maxmemory` with `noeviction`) is `TierFull`, which the manager's write breaker takes while
promotions go on; whether the server bounds the store at all is checked once, in the background
of the tier's first call (`tiers.redis_bounds`).

Anyone who can write to the server can put another type under a block's key (a list, say):
reads of its value answer WRONGTYPE, which is that object's fault, not the tier's (a `magic`
corrupt miss, refused and deleted like any foreign object; until then `SET NX` leaves it and
counts a duplicate). Pipelines read their replies one by one, so an error reply fails its own
command only and the others' values arrive. A reused fast-path connection the server closed
is replaced and its exchange sent once more: a SET NX of it that had landed then answers nil
(a duplicate of its own write: counted, harmless).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis import exceptions as redis_errors
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import URL_QUERY_ARGUMENT_PARSERS, parse_url

from tiering.batching import RawRead, RawWrite
from tiering.errors import (
    ConfigError,
    CorruptObject,
    TierError,
    TierFull,
    TierTimeout,
    TierUnavailable,
)
from tiering.keys import BlockKey
from tiering.options import TierOptions, option
from tiering.secrets import redact_text, redact_url, url_secrets
from tiering.tier import Buffer, NamespaceUsage, Tier, TierStat
from tiering.units import format_duration
from tiers.redis_bounds import BoundsCheck, read_memory
from tiers.redis_usage import WriteMarker, marker_name, scan_usage
from tiers.resp import ReplyError, RespConnection, RespError, RespPool, command, set_command

__all__ = ["RedisOptions", "RedisTier"]

T = TypeVar("T")

URL_QUERY = frozenset(URL_QUERY_ARGUMENT_PARSERS) | {
    "password",
    "username",
    "client_name",
    "ssl_cert_reqs",
    "ssl_ca_certs",
    "ssl_certfile",
    "ssl_keyfile",
}
"""Query arguments a Redis URL may carry (redis-py reads them as connection options)."""
URL_ARGUMENTS = URL_QUERY | {"host", "port", "path", "connection_class"}

DRAIN = 1 << 20
"""In a pipeline, a value too large for its block is dropped through the connection's buffer
when it is at most this long (the later replies stay readable on the same connection); a longer
one costs the connection instead, and the GETs after it are sent again on another: cheaper
than moving hundreds of MiB only to drop them."""
PIPELINE_MAX_VALUE = 512 << 10
PIPELINE_BYTES = 1 << 20
"""Value bytes per pipeline of a batch on the fast path: a batch of large blocks goes as several
pipelines, at most `streams` of them at once on as many connections; one connection carries its
replies one after another (BENCHMARKS.md, "Measurements behind design choices")."""


def _unshown(field: Any) -> Any:
    """`field` (an `option`) left out of the record's repr: a secret must not reach a log."""
    field.repr = False
    return field


@dataclass(frozen=True, kw_only=True, slots=True)
class RedisOptions(TierOptions):
    """The Redis tier's settings (any thread: a value)."""

    url: str = _unshown(  # it may carry a password
        option(
            "redis://127.0.0.1:6379/0",
            low=1,
            what="a URL like 'redis://host:6379/0'",
            help="The server, as redis-py reads it (`rediss://` for TLS).",
        )
    )
    username: str | None = option(None, help="The user to AUTH as (null: the URL's, or none).")
    password: str | None = _unshown(
        option(None, help="The password to AUTH with (null: the URL's, or none); use `${ENV_VAR}`.")
    )
    ttl: float | None = option(
        None,
        kind="duration",
        help="Blocks expire this long after they are written, in whole milliseconds (null: never).",
    )
    cluster: bool = option(False, help="Talk to a Redis Cluster through any of its nodes.")
    tls_ca_file: str | None = option(None, help="CA bundle for TLS (makes the URL `rediss://`).")
    tls_cert_file: str | None = option(None, help="Client certificate for TLS.")
    tls_key_file: str | None = option(None, help="Client key for TLS.")
    socket_timeout: float = option(2.0, kind="duration", help="Socket timeout of each command.")
    connect_timeout: float = option(1.0, kind="duration", help="Timeout of each connection.")
    streams: int = option(
        2,
        low=1,
        high=256,
        help="Connections a batch's values move on at once (fast path; more only add overhead "
        "against one single-threaded server).",
    )
    fast_path: bool = option(
        True,
        help="Move blocks through kvtier's own RESP client on plain TCP (false: redis-py only).",
    )

    def __post_init__(self) -> None:
        if self.ttl is not None and _milliseconds(self.ttl) is None:
            raise ConfigError(
                f"ttl: a whole number of milliseconds (Redis expires keys by the millisecond), "
                f"got {format_duration(self.ttl)}"
            )


def _milliseconds(seconds: float) -> int | None:
    """`seconds` in whole milliseconds (at least 1), or None where it is not that."""
    ms = round(seconds * 1000)
    return ms if ms >= 1 and abs(seconds * 1000 - ms) < 1e-3 else None  # (float error: < 1 µs)


class RedisTier(Tier):
    """Blocks in Redis, on the runtime's event loop thread (redis.asyncio and `tiers.resp`)."""

    type_name = "redis"
    persistent = True  # the server keeps blocks when this process restarts
    shared = True
    supports_listing = True
    writes_once = True  # SET NX on every path
    Options = RedisOptions
    options: RedisOptions

    def __init__(
        self,
        *,
        namespace: bytes,
        secret: bytes | None = None,
        name: str | None = None,
        **options: Any,
    ) -> None:
        """`url` as redis-py reads it (`rediss://` for TLS); `ttl` (seconds or a duration such
        as `1h`, in whole milliseconds) expires blocks (SET's PX); `cluster` talks to a Redis
        Cluster through any of its nodes; `fast_path: false` moves blocks through redis-py too
        (plain TCP only has the other)."""
        super().__init__(namespace=namespace, secret=secret, name=name, **options)
        settings = self.options
        url, username, password = settings.url, settings.username, settings.password
        connect_timeout = settings.connect_timeout
        self.ttl = settings.ttl
        self._prefix = f"kvtier:{self.namespace.hex()}:".encode()
        kwargs: dict[str, Any] = {
            "username": username,
            "password": password,
            "socket_timeout": settings.socket_timeout,
            "socket_connect_timeout": connect_timeout,
            "max_connections": 2 * self.concurrency,
            "socket_read_size": 1 << 20,  # large values come in fewer chunks (64 KiB default)
        }
        if settings.tls_ca_file or settings.tls_cert_file or settings.tls_key_file:
            kwargs |= {
                "ssl_ca_certs": settings.tls_ca_file,
                "ssl_certfile": settings.tls_cert_file,
                "ssl_keyfile": settings.tls_key_file,
            }
            if url.startswith("redis://"):
                url = "rediss://" + url[len("redis://") :]
        self.url = redact_url(url)
        """The server's URL as messages show it: its password masked (`tiering.secrets`)."""
        self._secrets = [password, *url_secrets(url)]
        try:
            where = parse_url(url)
            unknown = sorted(set(where) - URL_ARGUMENTS)
            if unknown:  # redis-py would pass it on and fail at the first connection
                raise ValueError(
                    f"unknown query argument {unknown[0]!r}; known: {', '.join(sorted(URL_QUERY))}"
                )
            if settings.cluster:
                del kwargs["max_connections"]

            if settings.cluster:
                self._client: Any = RedisCluster.from_url(url, **kwargs)
            else:
                self._client = aioredis.Redis.from_url(url, **kwargs)
        except ValueError as e:
            raise ConfigError(self._scrub(f"tier {self.name!r}: url {self.url!r}: {e}")) from None
        self._marker = WriteMarker(
            self._client,
            self.namespace,
            ttl=self.ttl,
            timeout=self.timeout,
            counters=self.counters,
        )
        self._fast: RespPool | None = None
        if (
            settings.fast_path
            and not settings.cluster
            and url.startswith("redis://")
            and "ssl_ca_certs" not in kwargs
        ):
            self._fast = RespPool(
                where.get("host", "127.0.0.1"),
                int(where.get("port", 6379)),
                size=2 * self.concurrency,
                username=username or where.get("username"),
                password=password or where.get("password"),
                db=int(where.get("db", 0)),
                connect_timeout=connect_timeout,
            )

        def one_server(host: str | None = None, port: int | None = None) -> Any:
            """A redis-py client of one server with the tier's settings: the URL's, or a Cluster
            master at `host`, `port` (URL options win over keywords, as in `from_url`)."""
            address = {} if host is None else {"host": host, "port": port}
            return aioredis.Redis.from_pool(
                aioredis.ConnectionPool(**{**kwargs, **where, **address})
            )

        self.bounds = BoundsCheck(
            self.name,
            lambda: read_memory(one_server, self._client if settings.cluster else None),
            self.capacity,
            self.ttl,
            timeout=self.timeout or 5.0,
            scrub=self._scrub,
        )
        """Whether the server bounds the store as `capacity` says: checked once, in the
        background of the first call of a writable tier (`tiers.redis_bounds`)."""

    async def _deadline(self, operation: Awaitable[T]) -> T:
        """The base's `_deadline` (every call goes through it); the first one of a writable
        tier starts the bounds check (the runtime's loop is the tier's only from its first
        call on)."""
        if not self.read_only:
            self.bounds.start()
        return await super()._deadline(operation)

    def _name(self, key: BlockKey) -> bytes:
        return self._prefix + key.hex().encode()

    def _scrub(self, message: str) -> str:
        """`message` without this tier's secrets, should a library or the server quote one."""
        return redact_text(message, self._secrets)

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except redis_errors.TimeoutError as e:
            raise TierTimeout(f"tier {self.name!r}: {what} timed out ({self.url})") from e
        except (redis_errors.ConnectionError, OSError) as e:
            message = self._scrub(f"tier {self.name!r}: {what} failed: {e} ({self.url})")
            raise TierUnavailable(message) from e
        except ReplyError as e:
            raise self._error_reply(e, what) from e
        except redis_errors.ResponseError as e:
            raise self._error_reply(e, what, wrong_type=False) from e
        except (redis_errors.RedisError, RespError) as e:
            raise TierError(self._scrub(f"tier {self.name!r}: {what} failed: {e}")) from e

    @contextlib.contextmanager
    def _one_value(self, what: str) -> Iterator[None]:
        """`_errors` around a read of one key's value, where a key of another type is that
        object's fault (`_not_a_string`). Batches decide reply by reply instead: raised out of
        a pipeline, a `CorruptObject` would be taken for every block's and refuse them all."""
        with self._errors(what):
            try:
                yield
            except (redis_errors.ResponseError, ReplyError) as e:
                if _wrong_type(e):
                    raise _not_a_string(e) from e
                raise

    def _error_reply(self, error: BaseException, what: str, wrong_type: bool = True) -> TierError:
        """What the server's error reply to one command means: a `magic` corrupt miss of that
        key when it holds another type (`_wrong_type`; `wrong_type` False where the reply
        cannot be a read's), `TierFull` when the server is out of memory (`OOM`), else a
        `TierError` (one that says so when the server is a Cluster node and the tier is not
        set to `cluster`)."""
        if wrong_type and _wrong_type(error):
            return _not_a_string(error)
        if isinstance(error, redis_errors.OutOfMemoryError) or str(error).startswith("OOM"):
            return TierFull(
                self._scrub(f"tier {self.name!r}: {what} refused, the server is full: {error}")
            )
        message = self._scrub(f"tier {self.name!r}: {what} failed: {error}")
        redirected = isinstance(error, redis_errors.MovedError | redis_errors.AskError)
        if (redirected or str(error).startswith(("MOVED ", "ASK "))) and not self.options.cluster:
            return TierError(f"{message} (the server is a Redis Cluster node: set cluster: true)")
        return TierError(message)

    async def _fast_get(self, key: BlockKey, read: Callable[[RespConnection], Awaitable[T]]) -> T:
        """GET on the fast path, its value read by `read`. An error reply is raised once the
        connection is back in the pool (it is still in step); a value too long for its block
        leaves the connection `broken`, and the pool drops it."""
        assert self._fast is not None
        request = [command(b"GET", self._name(key))]

        async def get(conn: RespConnection) -> T | ReplyError:
            await conn.send(request)
            try:
                return await read(conn)
            except ReplyError as e:
                return e

        with self._one_value("GET"):
            got = await self._fast.run(get)
            if isinstance(got, ReplyError):
                raise got
            return got

    async def _read(self, key: BlockKey, limit: int) -> Buffer | None:
        if self._fast is not None:
            return await self._fast_get(key, lambda conn: conn.value(limit))
        with self._one_value("GET"):
            name = self._name(key)
            head: bytes = await self._client.getrange(name, 0, limit)
            if not head:
                pipe = self._client.pipeline(transaction=False)
                replies = await pipe.exists(name).strlen(name).execute(raise_on_error=False)
                return _empty(_replies(replies))
            return _within(head, limit)

    async def _read_into(
        self, key: BlockKey, payload: memoryview, limit: int
    ) -> tuple[Buffer, bool] | None:
        """The object's header, its payload read straight into `payload` (see `ReadsInto`)."""
        if self._fast is None:
            blob = await self._read(key, limit)  # the whole object: verified by `_accept`
            return None if blob is None else (blob, False)
        return await self._fast_get(key, lambda conn: conn.value_into(payload, limit))

    async def _read_head(self, key: BlockKey, n: int) -> tuple[Buffer, int] | None:
        """Header and real size; a key that holds no string raises `CorruptObject("magic")`."""
        with self._one_value("GETRANGE"):
            name = self._name(key)
            pipe = self._client.pipeline(transaction=False)
            pipe.exists(name)
            pipe.strlen(name)
            pipe.getrange(name, 0, max(n, 1) - 1)  # an inclusive end; -1 would mean all of it
            replies = await pipe.execute(raise_on_error=False)
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply  # as the server worded it (no pipeline prefix): `_one_value`
            exists, size, head = replies
        return (head, size) if exists else None

    async def _write(self, key: BlockKey, parts: Sequence[Buffer]) -> bool:
        """SET NX: False when the key was there (nothing written)."""
        with self._errors("SET"):
            if self._fast is not None:
                request = set_command(self._name(key), parts, self._px(), nx=True)

                async def put(conn: RespConnection) -> bool:
                    await conn.send(request)
                    return await conn.reply() is not None

                return await self._fast.run(put)
            written = await self._client.set(
                self._name(key), b"".join(parts), px=self._px(), nx=True
            )
            return bool(written)

    async def _delete(self, key: BlockKey) -> bool:
        with self._errors("DEL"):
            return bool(await self._client.delete(self._name(key)))

    async def _contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        with self._errors("EXISTS"):
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._name(key))
            return [bool(n) for n in await pipe.execute()]

    async def _list(self) -> AsyncIterator[BlockKey]:
        with self._errors("SCAN"):
            async for name in self._client.scan_iter(match=self._prefix + b"*", count=1000):
                key = self.listed_key(name[len(self._prefix) :])
                if key is not None:
                    yield key

    async def _namespaces(self) -> list[bytes]:
        found: set[bytes] = set()
        with self._errors("SCAN"):
            async for name in self._client.scan_iter(match=b"kvtier:*", count=1000):
                parts = name.split(b":")
                if len(parts) == 3 and len(parts[1]) == 32:
                    try:
                        found.add(bytes.fromhex(parts[1].decode()))
                    except ValueError:
                        continue
        return sorted(found)

    async def _stat(self) -> TierStat:
        with self._errors("SCAN"):
            names = [n async for n in self._client.scan_iter(match=self._prefix + b"*", count=1000)]
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                pipe.strlen(name)
            sizes = _replies(await pipe.execute(raise_on_error=False)) if names else []
            used = 0  # a key that holds no string (WRONGTYPE) counts as an object of no bytes
            for size in sizes:
                if isinstance(size, int):
                    used += size
                elif not _wrong_type(size):
                    raise size
        return TierStat(len(names), used, self.capacity)

    async def _usage(self) -> list[NamespaceUsage]:
        """Every namespace under `kvtier:` on the server, every master of a Cluster
        (`tiers.redis_usage`: sizes by MEMORY USAGE, the last write from each namespace's
        marker)."""
        tally = await scan_usage(self._client, self._errors, time.time())
        return tally.result(self.name)

    async def drop_usage_marks(self) -> None:
        """Delete this namespace's marker (`tiering.usage.KeepsUsageMarks`: it was purged)."""
        await self._marker.close()
        with self._errors("DEL"):
            await self._client.delete(marker_name(self.namespace))

    def _count_put(self, written: bool | None, size: int) -> None:
        super()._count_put(written, size)
        self._marker.wrote()  # a duplicate too: an engine still uses the namespace

    async def _close(self) -> None:
        await self._marker.close()
        await self.bounds.stop()
        if self._fast is not None:
            self._fast.close()
        with contextlib.suppress(Exception):
            await self._client.aclose()

    def _px(self) -> int | None:
        """The expiry of a SET, in milliseconds (None: none)."""
        return None if self.ttl is None else _milliseconds(self.ttl)

    # -- pipelined batches ------------------------------------------------------------------------

    async def _read_many(
        self, keys: Sequence[BlockKey], payloads: Sequence[memoryview], limits: Sequence[int]
    ) -> list[RawRead]:
        """Pipelines of GETs, each answer as `_read_into`'s (a key that holds no string, or a
        value too large, refused unread: a `CorruptObject` in its place)."""
        if self._fast is not None and self.codec == "raw":
            return await self._read_many_fast(keys, payloads, limits)
        names = [self._name(key) for key in keys]
        what = "GET (pipelined)"

        async def fetch() -> list[Any]:
            with self._errors(what):
                pipe = self._client.pipeline(transaction=False)
                for name, limit in zip(names, limits, strict=True):
                    pipe.getrange(name, 0, limit)
                heads = _replies(await pipe.execute(raise_on_error=False))
                empty = [i for i, head in enumerate(heads) if head == b""]
                if empty:
                    pipe = self._client.pipeline(transaction=False)
                    for i in empty:
                        pipe.exists(names[i]).strlen(names[i])
                    replies = _replies(await pipe.execute(raise_on_error=False))
                    for n, i in enumerate(empty):
                        heads[i] = _empty(replies[2 * n : 2 * n + 2])
            return heads

        heads = await self._deadline(fetch())
        answers: list[RawRead] = []
        for head, limit in zip(heads, limits, strict=True):
            if isinstance(head, Exception):
                answers.append(self._error_reply(head, what))
                continue
            try:
                answers.append(None if head is None else (_within(head, limit), False))
            except CorruptObject as e:
                answers.append(e)
        return answers

    async def _write_many(
        self, objects: Sequence[tuple[BlockKey, Sequence[Buffer]]]
    ) -> list[RawWrite] | None:
        """One pipeline of SET NXs for small blocks; large ones go as concurrent SETs (None:
        the base's): a pipeline packs and sends large values one after another on one
        connection, concurrent SETs spread them over connections (BENCHMARKS.md,
        "Measurements behind design choices")."""
        if self._fast is not None:
            return await self._write_many_fast(objects)
        if max(len(parts[1]) for _, parts in objects) > PIPELINE_MAX_VALUE:
            return None
        what = "SET (pipelined)"

        async def store() -> list[Any]:
            with self._errors(what):
                pipe = self._client.pipeline(transaction=False)
                for key, parts in objects:
                    pipe.set(self._name(key), b"".join(parts), px=self._px(), nx=True)
                return _replies(await pipe.execute(raise_on_error=False))

        replies = await self._deadline(store())
        return [
            self._error_reply(r, what, wrong_type=False) if isinstance(r, Exception) else bool(r)
            for r in replies
        ]

    async def _read_many_fast(
        self, keys: Sequence[BlockKey], payloads: Sequence[memoryview], limits: Sequence[int]
    ) -> list[RawRead]:
        """Pipelines of GETs (`PIPELINE_BYTES` of values each, on as many connections at
        once), each value read into its buffer; a pipeline that fails fails its blocks only."""
        spans = _spans([len(view) for view in payloads], PIPELINE_BYTES)
        answers: list[RawRead] = []
        gate = asyncio.Semaphore(self.options.streams)
        pipelines = (self._fetch_pipeline(keys[s], payloads[s], limits[s], gate) for s in spans)
        for got in await _each(pipelines):
            answers += got
        return answers

    async def _fetch_pipeline(
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
                    got.append(self._error_reply(e, what))
                except CorruptObject as e:
                    got.append(e)
                    if conn.broken:
                        return

        async def fetch() -> None:  # the wait at `gate` too is under the deadline
            async with gate:
                with self._errors(what):
                    while len(got) < len(keys):
                        await fast.run(exchange)

        try:
            await self._deadline(fetch())
        except TierError as e:
            got += [e] * (len(keys) - len(got))
        return got

    async def _write_many_fast(
        self, objects: Sequence[tuple[BlockKey, Sequence[Buffer]]]
    ) -> list[RawWrite]:
        """Pipelines of SETs (`PIPELINE_BYTES` of values each, on as many connections at once),
        values sent from where they lie; a value the server refuses (an error reply) fails
        alone, a pipeline that fails fails its blocks only."""
        spans = _spans([len(parts[1]) for _, parts in objects], PIPELINE_BYTES)
        stored: list[RawWrite] = []
        gate = asyncio.Semaphore(self.options.streams)
        for got in await _each(self._store_pipeline(objects[s], gate) for s in spans):
            stored += got
        return stored

    async def _store_pipeline(
        self, objects: Sequence[tuple[BlockKey, Sequence[Buffer]]], gate: asyncio.Semaphore
    ) -> list[RawWrite]:
        assert self._fast is not None
        fast = self._fast
        px = self._px()
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
                    outcomes.append(self._error_reply(e, "SET", wrong_type=False))
            return outcomes

        async def store() -> list[RawWrite]:  # the wait at `gate` is under it too
            async with gate:
                with self._errors("SET (pipelined)"):
                    return await fast.run(exchange)

        try:
            return await self._deadline(store())
        except TierError as e:
            return [e] * len(objects)


def _wrong_type(error: BaseException) -> bool:
    """Whether an error reply says that the key holds another type than a string: WRONGTYPE,
    which only a command on one key's value (GET, GETRANGE, STRLEN) answers. Other error
    replies (LOADING, NOPERM, ...) are the server's state, not the object's: tier errors."""
    is_reply = isinstance(error, redis_errors.ResponseError | ReplyError)
    return is_reply and str(error).startswith("WRONGTYPE")


def _not_a_string(error: BaseException) -> CorruptObject:
    return CorruptObject("magic", f"not a string value: {error}")


def _replies(results: list[Any]) -> list[Any]:
    """The replies of a redis-py pipeline run with `raise_on_error=False`, each command's error
    reply in its place; any other failure raised, as without that flag (a Cluster pipeline puts
    a node's connection error in the list too)."""
    for result in results:
        if isinstance(result, Exception) and not isinstance(result, redis_errors.ResponseError):
            raise result
    return results


def _empty(replies: Sequence[Any]) -> bytes | None:
    """After an empty GETRANGE, EXISTS and STRLEN tell a missing key (None) from an empty value
    (b"", a corrupt object: refused and deleted); a value that appeared in between (or another
    type: STRLEN's error reply) is a miss, not an object to delete."""
    exists, size = replies
    return b"" if exists and size == 0 else None


def _within(head: bytes, limit: int) -> bytes:
    """A value read by `GETRANGE name 0 limit` (at most `limit + 1` bytes: a GET of a crafted
    512 MiB value would make redis-py read and allocate all of it), refused when it is longer
    than `limit` bytes."""
    if len(head) > limit:
        raise CorruptObject(
            "length", f"object of more than {limit} bytes, at most {limit} expected"
        )
    return head


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
