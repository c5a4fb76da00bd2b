"""Whether a Redis server bounds what it holds as the tier's `capacity` says (the runtime's
thread: once per writable tier, in the background of its first call, `BoundsCheck`).

kvtier cannot bound a store that other engines write: the server does, with `maxmemory` and a
`maxmemory-policy` that evicts kvtier's keys. The tier reads both (`CONFIG GET maxmemory*`, on
every master of a Cluster) and says in one line what to set where they cannot hold the store
to `capacity` (`judge`), and, at the info level, when its eviction samples too few keys to
evict by use (`advise`):

- `maxmemory` 0 (no bound), or more than `capacity` (the masters' sum, on a Cluster): the
  server may hold more than `capacity`;
- a policy that never evicts kvtier's keys, `noeviction`, or a `volatile-*` one without `ttl`
  (kvtier's keys then carry no expiry): once full, the server refuses every new block (an OOM
  reply, `TierFull`, which the manager's write breaker takes while promotions go on) and what it
  holds never renews. Said with no `capacity` too, where `maxmemory` is set.

A server that refuses CONFIG (many managed services rename or forbid it) gets one line saying
that it could not be checked. Nothing here changes the server's settings: they are its
operator's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis import exceptions as redis_errors

from tiering.errors import TierError
from tiering.units import format_size

__all__ = ["SAMPLES", "BoundsCheck", "ServerMemory", "advise", "judge", "read_memory", "redis_size"]

log = logging.getLogger(__name__)

EVICTS_ANY = frozenset({"allkeys-lru", "allkeys-lfu", "allkeys-random"})
EVICTS_EXPIRING = frozenset({"volatile-lru", "volatile-lfu", "volatile-random", "volatile-ttl"})
"""Policies that evict only keys with an expiry: kvtier's have one only with `ttl`."""
POLICY = "allkeys-lru"
"""The policy the warning suggests: least recently used first, whatever the key's expiry."""
SAMPLES = 64
"""The `maxmemory-samples` from which a shared tier's LRU is as good as exact (`advise`)."""
RETRY_AFTER = 10.0
"""Seconds before a check that could not reach the server is tried again (at a later call)."""


@dataclass(frozen=True, slots=True)
class ServerMemory:
    """One server's (one master's) memory settings as CONFIG GET answered them (a value)."""

    where: str
    """host:port."""
    maxmemory: int
    """Bytes; 0: no bound."""
    policy: str
    samples: int = 5
    """`maxmemory-samples`: the keys an approximated LRU or LFU eviction compares."""


def judge(capacity: int | None, ttl: float | None, servers: Sequence[ServerMemory]) -> str | None:
    """What the servers cannot guarantee and what to set on them, in one line (without the
    tier's name); None when they hold the store within `capacity`, or, without a `capacity`,
    when no bounded server refuses to evict kvtier's blocks."""
    faults: list[str] = []
    todo: list[str] = []
    if capacity is not None and servers:
        unbounded = [s.where for s in servers if s.maxmemory == 0]
        total = sum(s.maxmemory for s in servers)
        if unbounded:
            faults.append(f"maxmemory 0 (no bound) on {_listed(unbounded)}")
        elif total > capacity:
            what = "maxmemory" if len(servers) == 1 else "the masters' maxmemory add up to"
            faults.append(f"{what} {format_size(total)}, more than the capacity")
        if faults:
            todo.append(f"maxmemory {redis_size(capacity // len(servers))}")
    evicting = EVICTS_ANY | (EVICTS_EXPIRING if ttl is not None else frozenset())
    # without a capacity, a policy matters only where a maxmemory makes the server full
    judged = [s for s in servers if capacity is not None or s.maxmemory]
    refusing = sorted({s.policy for s in judged} - evicting)
    for policy in refusing:
        held = [s.where for s in judged if s.policy == policy]
        why = ": without ttl kvtier's keys never expire" if policy in EVICTS_EXPIRING else ""
        faults.append(
            f"maxmemory-policy {policy} on {_listed(held)} (never evicts kvtier's blocks{why})"
        )
    if refusing:
        todo.append(f"maxmemory-policy {POLICY}")
    if not faults:
        return None
    claim = (
        "the server refuses new blocks once full"
        if capacity is None
        else f"capacity {format_size(capacity)} is not guaranteed by the server"
    )
    where = "it" if len(servers) == 1 else f"each of its {len(servers)} masters"
    return f"{claim}: {'; '.join(faults)}; set {' and '.join(todo)} on {where}"


def advise(servers: Sequence[ServerMemory]) -> str | None:
    """What a server's eviction loses of "least recently used first", in one line (without the
    tier's name), or None: with `allkeys-lru` (or `-lfu`) Redis evicts the oldest of
    `maxmemory-samples` keys it samples, not the oldest of all; below `SAMPLES` a shared tier
    keeps less of what the fleet uses (the fleet replay of the shipped trace: 5 samples 3.4-6
    points of hit rate below an exact LRU, 64 within 0.05; BENCHMARKS.md)."""
    few = [
        s for s in servers if s.policy in EVICTS_ANY - {"allkeys-random"} and s.samples < SAMPLES
    ]
    if not few:
        return None
    counts = sorted({s.samples for s in few})
    return (
        f"maxmemory-samples {'/'.join(map(str, counts))} on {_listed([s.where for s in few])}: "
        f"{few[0].policy} evicts the oldest of a few sampled keys, not the oldest of all "
        f"(3-6 points of hit rate below exact LRU for a fleet); set maxmemory-samples {SAMPLES}"
    )


def _listed(places: Sequence[str]) -> str:
    return places[0] if len(places) == 1 else f"{len(places)} masters"


def redis_size(size: int) -> str:
    """`size` bytes as redis.conf writes sizes (`8gb`: binary units; `8g` would be 10^9)."""
    for unit, scale in (("gb", 1 << 30), ("mb", 1 << 20), ("kb", 1 << 10)):
        if size and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _memory(where: str, reply: Mapping[Any, Any]) -> ServerMemory:
    """A CONFIG GET reply (a mapping, bytes or str) as `ServerMemory`."""
    config = {_text(k): _text(v) for k, v in reply.items()}
    try:
        samples = int(config.get("maxmemory-samples", "5"))
        return ServerMemory(where, int(config["maxmemory"]), config["maxmemory-policy"], samples)
    except (KeyError, ValueError) as e:
        raise redis_errors.ResponseError(f"CONFIG GET answered no maxmemory: {e}") from None


async def read_memory(
    one_server: Callable[..., Any], cluster: Any | None = None
) -> list[ServerMemory]:
    """The memory settings of the server, or of every master of `cluster` (the tier's own
    `RedisCluster`, whose view of the masters it uses), each read through a client of its own
    (`one_server()`, `one_server(host, port)`), closed after: none of its connections stays in
    the pool of the tier's data path (one a restarted server closed would fail a command there)
    and no second Cluster client starts (its start reads the server's whole command table).
    Raises redis-py's errors: a `ResponseError` where the server refuses CONFIG."""
    places: list[tuple[str, int] | None] = [None]
    if cluster is not None:
        await asyncio.shield(cluster.initialize())  # the data path's: never cancelled from here
        places = [(node.host, node.port) for node in cluster.get_primaries()]
    found = []
    for place in places:
        client = one_server() if place is None else one_server(*place)
        try:
            reply = await client.config_get("maxmemory*")
        finally:
            await client.aclose()
        kwargs = client.connection_pool.connection_kwargs
        found.append(_memory(f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}", reply))
    return found


class BoundsCheck:
    """One tier's check of its server's bounds, on the runtime's thread: `start` (at each of the
    tier's calls) begins it once, as a task of its own that no caller waits for; it logs one
    line when the server cannot guarantee the capacity or refuses CONFIG, and nothing when it
    can. A check that could not reach the server is tried again at a call `RETRY_AFTER` later
    (the server may be down at start)."""

    def __init__(
        self,
        name: str,
        read: Callable[[], Awaitable[list[ServerMemory]]],
        capacity: int | None,
        ttl: float | None,
        timeout: float,
        scrub: Callable[[str], str],
    ) -> None:
        self.name = name
        self._read = read
        self.capacity = capacity
        self.ttl = ttl
        self.timeout = timeout
        self._scrub = scrub
        self._task: asyncio.Task[None] | None = None
        self._done = False
        self._failed_at = -RETRY_AFTER
        self.finding: str | None = None
        """The last line the check logged (None: none, or not checked yet)."""
        self.advice: str | None = None
        """The line it logged on the server's eviction sampling (`advise`), if any."""

    def start(self) -> None:
        if self._done or (self._task is not None and not self._task.done()):
            return
        if time.monotonic() - self._failed_at < RETRY_AFTER:
            return
        self._task = asyncio.get_running_loop().create_task(self._check())

    async def _check(self) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                servers = await self._read()
        except redis_errors.ResponseError as e:  # refused (NOPERM, unknown command): final
            self._done = True
            self._say(
                f"tier {self.name!r}: cannot check that the server bounds its memory (CONFIG "
                f"GET refused: {e}); make sure of maxmemory"
                + ("" if self.capacity is None else f" {redis_size(self.capacity)} at most")
                + f" and maxmemory-policy {POLICY} on it",
                logging.WARNING if self.capacity is not None else logging.INFO,
            )
            return
        except (TimeoutError, redis_errors.RedisError, OSError, TierError) as e:
            self._failed_at = time.monotonic()
            log.debug("tier %r: memory bounds not checked yet: %s", self.name, self._scrub(str(e)))
            return
        self._done = True
        finding = judge(self.capacity, self.ttl, servers)
        if finding is not None:
            self._say(f"tier {self.name!r}: {finding}", logging.WARNING)
        advice = advise(servers)
        if advice is not None:
            self.advice = self._scrub(f"tier {self.name!r}: {advice}")
            log.info("%s", self.advice)

    def _say(self, line: str, level: int) -> None:
        self.finding = self._scrub(line)
        log.log(level, "%s", self.finding)

    async def wait(self) -> None:
        """Until a check in flight has ended (tests and operators' commands)."""
        if self._task is not None:
            await asyncio.shield(self._task)

    async def stop(self) -> None:
        """Let a check in flight end (the tier is closing; it is bounded by `timeout`), then
        cancel it if it has not: a redis-py client cancelled mid-command can leave its
        connection open."""
        task = self._task
        if task is not None and not task.done():
            await asyncio.wait({task}, timeout=self.timeout)
            task.cancel()
