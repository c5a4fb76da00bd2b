"""The Redis tier: blocks as Redis strings, one server or a Redis Cluster.

Keys are `kvtier:<namespace hex>:<key hex>`, so several models share a server without seeing
each other's blocks and `kvtier ls` can scan one namespace. Batches (`contains`, `get_many`,
`put_many`) go in pipelines (`tiers.redis.pipelines`); its settings are `tiers.redis.options`,
its error translation `tiers.redis.errors`, the wire protocol `tiers.redis.resp`.

Blocks move through `tiers.redis.resp` on a plain-TCP server: a GET lands in the primary slot
with no intermediate copy and a SET sends header and payload from where they lie (redis-py copies a
value two or three times on the way). TLS and Cluster go through redis-py (`redis.asyncio`,
which packs large values faster than hiredis's packer), as do the other
commands; with TLS the tier says so once in the log, at open. Connection errors become
`TierUnavailable`; the tier's deadline bounds every call.

TLS (`rediss://`, or any `tls_*` option) is tried at open (`tiers.tls`): a wrong CA, an
expired certificate or a plaintext server is a one-line `TlsError` there, never a fall back to
plaintext; should one happen later (a server's certificate replaced), the call raises it.

Every write is `SET NX` (with `EX` when `ttl` is set, in the same command), on every path: of
engines writing one block at once, one writes it and the others' SETs answer nil, counted as
`duplicates` (nothing sent twice is stored twice, and no engine replaces an object it cannot
read: another secret's stays). A damaged object is deleted by the reader that refuses it, so
the next write lands. A SET the server refuses because it is full (an OOM reply:
`maxmemory` with `noeviction`) is `TierFull`, which the manager's write breaker takes while
promotions go on; whether the server bounds the store at all is checked once, in the background
of the tier's first call (`tiers.redis.bounds`).

Anyone who can write to the server can put another type under a block's key (a list, say):
reads of its value answer WRONGTYPE, which is that object's fault, not the tier's (a `magic`
corrupt miss, refused and deleted like any foreign object; until then `SET NX` leaves it and
counts a duplicate). A reused fast-path connection the server closed is replaced and its
exchange sent once more: a SET NX of it that had landed then answers nil (a duplicate of its
own write: counted, harmless).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import parse_url

from tiering.errors import ConfigError, CorruptObject
from tiering.keys import BlockKey
from tiering.secrets import UNENCODED_PASSWORD, password_needs_encoding, redact_url, url_secrets
from tiering.tier import Buffer, NamespaceUsage, Tier, TierStat
from tiering.tier.batching import RawRead, RawWrite
from tiering.tier.records import RECORD_PAGE
from tiers.redis.bounds import BoundsCheck, read_memory
from tiers.redis.errors import RedisErrors, empty, replies, within, wrong_type
from tiers.redis.options import URL_ARGUMENTS, URL_QUERY, RedisOptions, milliseconds
from tiers.redis.pipelines import Pipelines
from tiers.redis.resp import ReplyError, RespConnection, command, set_command
from tiers.redis.resp_pool import RespPool
from tiers.redis.usage import WriteMarker, marker_name, scan_usage
from tiers.tls import check_handshake, client_context

__all__ = ["RedisOptions", "RedisTier"]

T = TypeVar("T")


def _glob(name: bytes) -> bytes:
    """`name` as a SCAN pattern that matches it alone (its glob characters escaped)."""
    for special in (b"\\", b"*", b"?", b"[", b"]"):
        name = name.replace(special, b"\\" + special)
    return name


log = logging.getLogger(__name__)

_DELETE_IF_SEEN = """
local value = redis.call('GETRANGE', KEYS[1], 0, string.len(ARGV[1]) - 1)
if value == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
"""DEL the key while its value begins with ARGV[1] (a refused object's head as read)."""


class RedisTier(Tier):
    """Blocks in Redis, on the runtime's event loop thread (redis.asyncio and
    `tiers.redis.resp`)."""

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
        tls = url.startswith("rediss://")
        if tls:
            kwargs["ssl_check_hostname"] = True  # as `check_handshake` does
        self.url = redact_url(url)
        """The server's URL as messages show it: its password masked (`tiering.secrets`)."""
        self._errors = RedisErrors(
            self.name, self.url, [password, *url_secrets(url)], settings.cluster
        )
        if password_needs_encoding(url):  # redis-py would quote a piece of it as the port
            raise ConfigError(f"tier {self.name!r}: url {self.url!r}: {UNENCODED_PASSWORD}")
        try:
            where: dict[str, Any] = dict(parse_url(url))
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
            raise ConfigError(
                self._errors.scrub(f"tier {self.name!r}: url {self.url!r}: {e}")
            ) from None
        self._marker = WriteMarker(
            self._client,
            self.namespace,
            ttl=self.ttl,
            timeout=self.timeout,
            counters=self.counters,
        )
        if tls:
            self._check_tls(where, connect_timeout)
        self._fast: RespPool | None = None
        if settings.fast_path and not settings.cluster and tls:
            log.info(
                "tier %r: TLS: blocks move through redis-py (the fast path speaks plain TCP only)",
                self.name,
            )
        elif settings.fast_path and not settings.cluster and url.startswith("redis://"):
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
            scrub=self._errors.scrub,
        )
        """Whether the server bounds the store as `capacity` says: checked once, in the
        background of the first call of a writable tier (`tiers.redis.bounds`)."""
        self._pipelines = Pipelines(
            client=self._client,
            fast=self._fast,
            name=self._name,
            errors=self._errors,
            deadline=self._deadline,
            px=self._px(),
            streams=settings.streams,
        )

    def _check_tls(self, where: dict[str, Any], timeout: float) -> None:
        """The TLS of the URL's server, tried once at open: a CA or certificate file that
        cannot be read is a `ConfigError`; a wrong CA, an expired certificate or a plaintext
        server a `TlsError` (`tiers.tls`), never a fall back to plaintext. (Of a Cluster,
        the node the URL names: the others share its CA.)"""
        settings = self.options
        context = client_context(
            self.name,
            settings.tls_ca_file or where.get("ssl_ca_certs"),
            settings.tls_cert_file or where.get("ssl_certfile"),
            settings.tls_key_file or where.get("ssl_keyfile"),
        )
        host, port = where.get("host", "127.0.0.1"), int(where.get("port", 6379))
        check_handshake(self.name, host, port, context, timeout, hello=b"PING\r\n")

    async def _deadline(self, operation: Awaitable[T]) -> T:
        """The base's `_deadline` (every call goes through it); the first one of a writable
        tier starts the bounds check (the runtime's loop is the tier's only from its first
        call on)."""
        if not self.read_only:
            self.bounds.start()
        return await super()._deadline(operation)

    def _name(self, key: BlockKey) -> bytes:
        return self._prefix + key.hex().encode()

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

        with self._errors.one_value("GET"):
            got = await self._fast.run(get)
            if isinstance(got, ReplyError):
                raise got
            return got

    async def _read(self, key: BlockKey, limit: int) -> Buffer | None:
        if self._fast is not None:
            return await self._fast_get(key, lambda conn: conn.value(limit))
        with self._errors.one_value("GET"):
            name = self._name(key)
            head: bytes = await self._client.getrange(name, 0, limit)
            if not head:
                pipe = self._client.pipeline(transaction=False)
                answers = await pipe.exists(name).strlen(name).execute(raise_on_error=False)
                return empty(replies(answers))
            return within(head, limit)

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
        with self._errors.one_value("GETRANGE"):
            name = self._name(key)
            pipe = self._client.pipeline(transaction=False)
            pipe.exists(name)
            pipe.strlen(name)
            pipe.getrange(name, 0, max(n, 1) - 1)  # an inclusive end; -1 would mean all of it
            answers = await pipe.execute(raise_on_error=False)
            for reply in answers:
                if isinstance(reply, Exception):
                    raise reply  # as the server worded it (no pipeline prefix): `_one_value`
            exists, size, head = answers
        return (head, size) if exists else None

    def _record_name(self, name: str) -> bytes:
        """A record's key (`tiering.tier.records`): outside the blocks' prefix, so no listing,
        count or scan of blocks meets it."""
        return f"kvtier-record:{self.namespace.hex()}:{name}".encode()

    async def _read_record(self, name: str, limit: int) -> Buffer | None:
        with self._errors.one_value("GETRANGE"):
            head: bytes = await self._client.getrange(self._record_name(name), 0, limit)
        if len(head) > limit:
            raise CorruptObject("length", f"record of more than {limit} bytes")
        return head or None

    async def _write_record(self, name: str, blob: bytes) -> bool:
        """A plain SET (a record is replaced, never written once), without a TTL."""
        with self._errors.around("SET"):
            await self._client.set(self._record_name(name), blob)
        return True

    async def _delete_record(self, name: str) -> bool:
        with self._errors.around("DEL"):
            return bool(await self._client.delete(self._record_name(name)))

    async def _list_records(self, prefix: str, limit: int) -> list[str]:
        """A SCAN of the records' prefix (`RECORD_PAGE` names a call): its cost grows with
        the server's keys, as every SCAN's, its memory with `limit` only."""
        base = self._record_name("")
        match = _glob(base + prefix.encode()) + b"*"
        found: list[str] = []
        with self._errors.around("SCAN"):
            async for key in self._client.scan_iter(match=match, count=RECORD_PAGE):
                found.append(key[len(base) :].decode("ascii", "replace"))
                if len(found) >= limit:
                    break
        return found

    async def _write(self, key: BlockKey, parts: Sequence[Buffer]) -> bool:
        """SET NX: False when the key was there (nothing written)."""
        with self._errors.around("SET"):
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
        with self._errors.around("DEL"):
            return bool(await self._client.delete(self._name(key)))

    async def _delete_refused(self, key: BlockKey, seen: bytes | None) -> bool:
        """DEL while the value still begins with `seen`, compared and deleted in one script
        (atomic on the server); without `seen`, DEL."""
        if seen is None:
            return await self._delete(key)
        with self._errors.around("EVAL"):
            return bool(await self._client.eval(_DELETE_IF_SEEN, 1, self._name(key), seen))

    async def _contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        with self._errors.around("EXISTS"):
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._name(key))
            return [bool(n) for n in await pipe.execute()]

    async def _list(self) -> AsyncIterator[BlockKey]:
        with self._errors.around("SCAN"):
            async for name in self._client.scan_iter(match=self._prefix + b"*", count=1000):
                key = self.listed_key(name[len(self._prefix) :])
                if key is not None:
                    yield key

    async def _namespaces(self) -> list[bytes]:
        found: set[bytes] = set()
        with self._errors.around("SCAN"):
            async for name in self._client.scan_iter(match=b"kvtier:*", count=1000):
                parts = name.split(b":")
                if len(parts) == 3 and len(parts[1]) == 32:
                    try:
                        found.add(bytes.fromhex(parts[1].decode()))
                    except ValueError:
                        continue
        return sorted(found)

    async def _stat(self) -> TierStat:
        with self._errors.around("SCAN"):
            names = [n async for n in self._client.scan_iter(match=self._prefix + b"*", count=1000)]
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                pipe.strlen(name)
            sizes = replies(await pipe.execute(raise_on_error=False)) if names else []
            used = 0  # a key that holds no string (WRONGTYPE) counts as an object of no bytes
            for size in sizes:
                if isinstance(size, int):
                    used += size
                elif not wrong_type(size):
                    raise size
        return TierStat(len(names), used, self.capacity)

    async def _usage(self) -> list[NamespaceUsage]:
        """Every namespace under `kvtier:` on the server, every master of a Cluster
        (`tiers.redis.usage`: sizes by MEMORY USAGE, the last write from each namespace's
        marker)."""
        tally = await scan_usage(self._client, self._errors.around, time.time())
        return tally.result(self.name)

    async def drop_usage_marks(self) -> None:
        """Delete this namespace's marker (`tiering.tier.usage.KeepsUsageMarks`: it was purged)."""
        await self._marker.close()
        with self._errors.around("DEL"):
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
        return None if self.ttl is None else milliseconds(self.ttl)

    # -- pipelined batches (`tiers.redis.pipelines`) ---------------------------------------------

    async def _read_many(
        self, keys: Sequence[BlockKey], payloads: Sequence[memoryview], limits: Sequence[int]
    ) -> list[RawRead]:
        """Pipelines of GETs, each answer as `_read_into`'s."""
        return await self._pipelines.read(keys, payloads, limits, into=self.codec == "raw")

    async def _write_many(
        self, objects: Sequence[tuple[BlockKey, Sequence[Buffer]]]
    ) -> list[RawWrite] | None:
        """Pipelines of SET NXs (None: large values without the fast path, sent one by one)."""
        return await self._pipelines.write(objects)
