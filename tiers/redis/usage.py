"""The Redis tier's store-wide usage, and the marker that says when a namespace was last
written: on the runtime's loop, like the tier (`tiers.redis.RedisTier._usage`, `_count_put`).

- **Names.** `kvtier:<namespace hex>:<key hex>` is a block; `kvtier:<namespace hex>` (no third
  part, so no block listing, `kvtier:<namespace hex>:*`, can take it for a block) is the
  namespace's marker; any other name under `kvtier:` is no kvtier name and is left out.
- **Usage.** One SCAN of `kvtier:*` (on a Cluster, of every master: redis-py's cluster SCAN
  visits each), `PAGE` names at a time, each page answered by one pipeline: `MEMORY USAGE` of
  each block (the bytes the server holds for it, value, key and allocator's rounding: what
  `maxmemory` counts) and the markers' values. Not STRLEN or GETRANGE, which touch every key's
  LRU/LFU clock: a poll every 30 s would make every block look as recently used as any other to
  the server's eviction. A server that refuses MEMORY (an ACL, a managed service) is asked
  STRLEN instead (the value's length; touching the keys, as said).
- **Last write.** Every writer refreshes its namespace's marker with the Unix time of a put, at
  most every `MARK_EVERY` seconds and in the background (a put never waits for it), so a
  namespace's last write is known to within that; with the blocks' `ttl` the marker expires
  `MARK_EVERY` after them. Without a marker (blocks written by an older kvtier, or the marker
  evicted), the namespace's last *access* stands in: now minus the least `OBJECT IDLETIME` of
  its blocks (a second SCAN, of that namespace only). An access is never earlier than the
  write, so an idle-for purge never takes a namespace written more recently than it asked;
  under an LFU `maxmemory-policy` Redis keeps no idle time and the last write is unknown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from redis import exceptions as redis_errors

from tiering.errors import KeyFormatError
from tiering.keys import key_from_hex
from tiering.tier.usage import UsageTally, namespace_of

__all__ = ["MARK_EVERY", "PAGE", "WriteMarker", "marker_name", "scan_usage"]

log = logging.getLogger(__name__)

PREFIX = b"kvtier:"
MARK_EVERY = 60.0
"""Seconds between two refreshes of a namespace's marker by one writer."""
PAGE = 1000
"""Names per SCAN call and per pipeline of a usage listing."""
_MARKER_BYTES = 64
"""The most of a marker's value read (a planted 512 MiB string costs nothing)."""


def marker_name(namespace: bytes) -> bytes:
    return PREFIX + namespace.hex().encode()


class WriteMarker:
    """Runtime thread: a namespace's marker, refreshed after puts at most every `every`
    seconds, one SET in flight at a time; a failure is counted (`marker_errors`) and the next
    put tries again."""

    def __init__(
        self,
        client: Any,
        namespace: bytes,
        *,
        ttl: float | None,
        timeout: float | None,
        counters: Counter[str],
        every: float = MARK_EVERY,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._client = client
        self._name = marker_name(namespace)
        self._ex = None if ttl is None else max(1, round(ttl + every))
        self._timeout = timeout
        self._counters = counters
        self._every = every
        self._clock = clock
        self._due = 0.0
        self._task: asyncio.Task[None] | None = None

    def wrote(self) -> None:
        """A put of the namespace ended (on the loop): refresh the marker if it is due."""
        now = self._clock()
        if now < self._due or (self._task is not None and not self._task.done()):
            return
        self._due = now + self._every
        self._task = asyncio.get_running_loop().create_task(self._mark(now))

    async def _mark(self, now: float) -> None:
        try:
            async with asyncio.timeout(self._timeout):
                await self._client.set(self._name, f"{now:.3f}".encode(), ex=self._ex)
        except Exception as e:  # noqa: BLE001 - a marker's failure is a counter, never a put's
            self._counters["marker_errors"] += 1
            self._due = 0.0
            log.debug("redis marker %s not written: %s", self._name.decode(), e)

    async def close(self) -> None:
        """Let the SET in flight end (within its deadline): before the tier closes, and
        before the marker is deleted (a SET landing after the DEL would bring it back)."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            with contextlib.suppress(Exception):
                await asyncio.wait([task], timeout=self._timeout)


async def scan_usage(
    client: Any, errors: Callable[[str], AbstractContextManager[None]], now: float
) -> UsageTally:
    """Every namespace under `kvtier:` on the server (every master of a Cluster), in one SCAN:
    blocks, their bytes (`MEMORY USAGE`), the marker's time or, without one, the last access
    (now minus the least `OBJECT IDLETIME` of its blocks, asked beside their sizes)."""
    tally = UsageTally()
    least_idle: dict[bytes, int] = {}
    sizes = "memory_usage"
    page: list[bytes] = []
    with errors("SCAN"):
        async for name in client.scan_iter(match=PREFIX + b"*", count=PAGE):
            page.append(name)
            if len(page) >= PAGE:
                sizes = await _tally_page(client, page, tally, sizes, least_idle)
                page = []
        if page:
            await _tally_page(client, page, tally, sizes, least_idle)
    for namespace in sorted(tally.namespaces()):
        if not tally.has_write_time(namespace) and namespace in least_idle:
            tally.add(namespace, 0, now - least_idle[namespace], objects=0)
    return tally


def _parse(name: bytes) -> tuple[bytes, bool] | None:
    """(namespace, is a block) of a name under the prefix; None for no kvtier name."""
    parts = name[len(PREFIX) :].split(b":", 1)
    namespace = namespace_of(parts[0])
    if namespace is None:
        return None
    if len(parts) == 1:
        return namespace, False
    try:
        key_from_hex(parts[1].decode("ascii"))
    except (KeyFormatError, UnicodeDecodeError):
        return None
    return namespace, True


async def _tally_page(
    client: Any, page: list[bytes], tally: UsageTally, sizes: str, least_idle: dict[bytes, int]
) -> str:
    """One pipeline for a page of names: each block's size and idle time, each marker's
    value; the size command that worked (STRLEN once MEMORY USAGE is refused)."""
    parsed = [(name, _parse(name)) for name in page]
    known = [(name, found) for name, found in parsed if found is not None]
    if not known:
        return sizes
    pipe = client.pipeline(transaction=False)
    for name, (_, block) in known:
        if block:
            getattr(pipe, sizes)(name)  # memory_usage, or strlen
            pipe.object("IDLETIME", name)  # (touches no key's LRU clock)
        else:
            pipe.getrange(name, 0, _MARKER_BYTES - 1)
    replies = iter(await pipe.execute(raise_on_error=False))
    answers = [(found, next(replies), next(replies) if found[1] else None) for _, found in known]
    if sizes == "memory_usage" and any(
        isinstance(size, redis_errors.ResponseError) and not _wrong_type(size)
        for (_, block), size, _ in answers
        if block
    ):
        log.warning("redis: MEMORY USAGE refused; usage counts STRLEN (it touches every key)")
        return await _tally_page(client, page, tally, "strlen", least_idle)
    for (namespace, block), reply, idle in answers:
        for answer in (reply, idle):
            if isinstance(answer, Exception) and not isinstance(answer, redis_errors.ResponseError):
                raise answer  # the node's connection, not the key
        if block:
            if reply is None:  # gone since the SCAN (expired, evicted, deleted)
                continue
            tally.add(namespace, reply if isinstance(reply, int) else 0)
            if isinstance(idle, int):  # (an LFU policy answers an error: no access time)
                least_idle[namespace] = min(idle, least_idle.get(namespace, idle))
        elif isinstance(reply, bytes):
            when = _marker_time(reply)
            if when is not None:
                tally.written(namespace, when)
    return sizes


def _marker_time(value: bytes) -> float | None:
    try:
        when = float(value.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None
    return when if 0 <= when < 1e11 else None  # NaN, infinity and other planted values fail


def _wrong_type(error: BaseException) -> bool:
    return str(error).startswith("WRONGTYPE")
