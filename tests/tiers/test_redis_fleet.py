"""Engines sharing one Redis at the same time (issue 28), on a real redis-server and a 3-master
Redis Cluster: writers in two processes write each block once (SET NX), a block one process
writes is found by another while both run, and what a stranger or a failing server does to a
batch of SET NX (another type, a lying header, the server going away, a slot moving) is a miss
or a counted error, never a crash, a hang or a wrong block."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from kvtier.servers import RedisClusterServers, RedisServer
from tiering.errors import TierError
from tiering.keys import BlockKey
from tiering.testing import NAMESPACE, key, payload
from tiering.testing.crafted import corrupt_variants
from tiering.tier.format import decode_header
from tiers.redis import RedisTier
from tiers.redis.resp import set_command

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parents[2]


def name(k: BlockKey) -> bytes:
    return f"kvtier:{NAMESPACE.hex()}:{k.hex()}".encode()


def flush(server: RedisServer | RedisClusterServers) -> None:
    nodes = server.nodes if isinstance(server, RedisClusterServers) else [server]
    for node in nodes:
        client = redis.Redis(host="127.0.0.1", port=node.port)
        client.flushall()
        client.close()


def raw_client(server: RedisServer | RedisClusterServers) -> redis.Redis | redis.RedisCluster:
    if isinstance(server, RedisClusterServers):
        return redis.RedisCluster(host="127.0.0.1", port=server.nodes[0].port)
    return redis.Redis(host="127.0.0.1", port=server.port)


def options(server: RedisServer | RedisClusterServers, transport: str) -> dict[str, Any]:
    """The tier's options for `transport`: resp (kvtier's RESP client), redis-py, cluster."""
    if transport == "cluster":
        assert isinstance(server, RedisClusterServers)
        return {"url": server.url, "cluster": True}
    return {"url": server.url, "fast_path": transport == "resp"}


def worker(args: dict[str, Any], **popen: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.tiers.redis_worker", json.dumps(args)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def finished(process: subprocess.Popen[str], timeout: float = 120) -> str:
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        process.kill()
    assert process.returncode == 0, err
    return out


@pytest.fixture(params=["resp", "redis-py", "cluster"])
def shared(
    request: pytest.FixtureRequest,
    redis_server: RedisServer,
    redis_cluster: RedisClusterServers,
) -> Iterator[tuple[RedisServer | RedisClusterServers, str]]:
    """A server with nothing on it, and the transport the tiers use on it."""
    transport: str = request.param
    server: RedisServer | RedisClusterServers = (
        redis_cluster if transport == "cluster" else redis_server
    )
    flush(server)
    yield server, transport
    flush(server)


# -- write once -----------------------------------------------------------------------------------


def test_set_command_sends_nx_and_the_expiry_in_one_command() -> None:
    assert b"".join(set_command(b"k", [b"ab", b"c"], None, nx=True)) == (
        b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$3\r\nabc\r\n$2\r\nNX\r\n"
    )
    assert b"".join(set_command(b"k", [b"v"], 60_000, nx=True)) == (
        b"*6\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n$2\r\nNX\r\n$2\r\nPX\r\n$5\r\n60000\r\n"
    )
    assert b"".join(set_command(b"k", [b"v"], None)) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n"


def test_two_processes_writing_the_same_blocks_at_once_write_each_once(
    shared: tuple[RedisServer | RedisClusterServers, str],
) -> None:
    """Two engines' tiers, in two processes, write the same 192 blocks at the same moment (one
    from the first key, one from the last: they meet in the middle): each key holds one
    whole object that verifies, written by one of them; every other put found it and was
    counted as a duplicate (puts and duplicates add up: 384 puts, 192 written)."""
    server, transport = shared
    n, size = 192, 64 << 10
    common = {"role": "write", "tier": options(server, transport), "n": n, "size": size}
    writers = [
        worker(common | {"batch": 8, "reverse": r}, stdin=subprocess.PIPE) for r in (False, True)
    ]
    for w in writers:  # both connected: start them together
        assert w.stdout is not None and json.loads(w.stdout.readline()) == {"ready": True}
    for w in writers:
        assert w.stdin is not None
        w.stdin.write("go\n")
        w.stdin.flush()
    results = [json.loads(finished(w)) for w in writers]
    first, second = results
    assert first["start"] < second["end"] and second["start"] < first["end"], "not at once"
    assert [r["errors"] for r in results] == [[], []]
    puts = sum(r["counters"]["puts"] for r in results)
    duplicates = sum(r["counters"].get("duplicates", 0) for r in results)
    assert (puts, duplicates) == (2 * n, n)
    assert sum(r["counters"].get("duplicate_bytes", 0) for r in results) == n * size
    written = {
        r["writer"]: r["counters"]["puts"] - r["counters"].get("duplicates", 0) for r in results
    }

    raw = raw_client(server)
    try:
        by_writer: Counter[str] = Counter()
        for i in range(n):
            blob = raw.get(name(key(i)))
            assert blob is not None, i
            header = decode_header(blob, key(i), NAMESPACE)
            assert header.writer is not None
            by_writer[header.writer.hex()] += 1
    finally:
        raw.close()
    assert dict(by_writer) == {w: c for w, c in written.items() if c}  # each wrote what it counted

    async def read_back() -> None:
        async with RedisTier(namespace=NAMESPACE, **options(server, transport)) as reader:
            buffers = [bytearray(size) for _ in range(n)]
            found = await reader.get_many([(key(i), b) for i, b in enumerate(buffers)])
            assert found == [True] * n
            assert all(bytes(b) == payload(size, i) for i, b in enumerate(buffers))
            assert reader.counters["hits_other_writer"] == n
            assert not any(c.startswith("corrupt") for c in reader.counters)

    asyncio.run(read_back())


@pytest.mark.parametrize("transport", ["resp", "redis-py"])
def test_a_put_of_a_key_another_writer_holds_is_a_duplicate_and_leaves_it(
    redis_server: RedisServer, transport: str
) -> None:
    """One block, one batch: the second writer's SET NX writes nothing (its object, with its
    own writer tag, never replaces the first's), and both count what happened."""
    flush(redis_server)
    size = 4096

    async def body() -> None:
        async with (
            RedisTier(namespace=NAMESPACE, **options(redis_server, transport)) as a,
            RedisTier(namespace=NAMESPACE, **options(redis_server, transport)) as b,
        ):
            await a.put(key(1), payload(size, 1))
            first = raw_value(redis_server, key(1))
            await b.put(key(1), payload(size, 1))
            assert await b.put_many([(key(1), payload(size, 1)), (key(2), payload(size, 2))]) == [
                None,
                None,
            ]
            assert raw_value(redis_server, key(1)) == first
            assert (b.counters["puts"], b.counters["duplicates"]) == (3, 2)
            assert b.counters["duplicate_bytes"] == 2 * size
            assert b.counters["bytes_written"] == size  # key(2) alone
            assert a.counters["duplicates"] == 0

    asyncio.run(body())


def raw_value(server: RedisServer, k: BlockKey) -> bytes | None:
    client = redis.Redis(host="127.0.0.1", port=server.port)
    try:
        value: bytes | None = client.get(name(k))
        return value
    finally:
        client.close()


@pytest.mark.parametrize("transport", ["resp", "redis-py"])
def test_nx_and_the_ttl_go_together(redis_server: RedisServer, transport: str) -> None:
    """With `ttl`, a written block expires and a duplicate put leaves the key's expiry as the
    first write set it (one command: no moment without an expiry)."""
    flush(redis_server)

    async def body() -> None:
        tier = RedisTier(namespace=NAMESPACE, ttl="30s", **options(redis_server, transport))
        async with tier:
            await tier.put(key(1), payload(4096, 1))
            client = redis.Redis(host="127.0.0.1", port=redis_server.port)
            client.expire(name(key(1)), 100)  # as if written earlier, with a longer ttl
            await tier.put_many([(key(1), payload(4096, 1)), (key(2), payload(4096, 2))])
            ttls = [client.ttl(name(key(i))) for i in (1, 2)]
            client.close()
            assert 90 < ttls[0] <= 100 and 0 < ttls[1] <= 30, ttls
            assert tier.counters["duplicates"] == 1

    asyncio.run(body())


# -- live sharing ---------------------------------------------------------------------------------


def test_a_block_another_process_writes_is_found_while_it_runs(
    shared: tuple[RedisServer | RedisClusterServers, str],
) -> None:
    """Engine A (a process of its own) writes a block every 50 ms; engine B (this process),
    told of each put once it has returned, finds the block by its first `contains` and loads it
    with `get`, while A still runs: visibility is immediate at the store (no index to refresh;
    the manager's negative cache is the only delay an engine sees: DESIGN.md)."""
    server, transport = shared
    n, size = 20, 64 << 10
    args = {"role": "share", "tier": options(server, transport), "n": n, "size": size}
    writer = worker(args | {"interval": 0.05, "linger": 1.0})
    seen: list[tuple[float, float]] = []  # (A's put returned, B's get returned)

    async def follow() -> None:
        assert writer.stdout is not None
        async with RedisTier(namespace=NAMESPACE, **options(server, transport)) as reader:
            await reader.contains([key(n)])  # connected, as a running engine is
            assert await reader.contains([key(0)]) == [False]
            for _ in range(n):
                line = await asyncio.wait_for(asyncio.to_thread(writer.stdout.readline), 30)
                event = json.loads(line)
                assert await reader.contains([key(event["i"])]) == [True], event
                assert await reader.get_bytes(key(event["i"]), size) == payload(size, event["i"])
                seen.append((event["t"], time.monotonic()))
            assert reader.counters["hits_other_writer"] == n
            end = json.loads(await asyncio.to_thread(writer.stdout.readline))["end"]
        assert all(got < end for _, got in seen), "read after the writer ended"

    try:
        asyncio.run(follow())
    finally:
        finished(writer)
    lags = sorted(got - put for put, got in seen)
    assert lags[-1] < 1.0, lags  # told, checked and read: one pipe, two round trips


# -- attacks --------------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["resp", "redis-py"])
@pytest.mark.parametrize("batched", [False, True], ids=["put", "put_many"])
def test_a_key_holding_another_type_is_left_by_set_nx_until_a_reader_removes_it(
    redis_server: RedisServer, transport: str, batched: bool
) -> None:
    """A list where a block belongs: SET NX finds the key and writes nothing (a duplicate, not
    an error), the read that meets it is a `magic` miss that deletes it, and the next put
    lands. Never an error for the batch, never a wrong block."""
    flush(redis_server)
    size = 4096
    client = redis.Redis(host="127.0.0.1", port=redis_server.port)

    async def put(tier: RedisTier, i: int) -> None:
        if batched:
            assert await tier.put_many(
                [(key(i), payload(size, i)), (key(9), payload(size, 9))]
            ) == [
                None,
                None,
            ]
        else:
            await tier.put(key(i), payload(size, i))

    async def body() -> None:
        async with RedisTier(namespace=NAMESPACE, **options(redis_server, transport)) as tier:
            client.rpush(name(key(1)), b"not", b"a block")
            await put(tier, 1)
            assert client.type(name(key(1))) == b"list" and tier.counters["duplicates"] == 1
            assert await tier.get(key(1), bytearray(size)) is False
            assert tier.counters["corrupt.magic"] == 1 and client.exists(name(key(1))) == 0
            await put(tier, 1)
            assert await tier.get_bytes(key(1), size) == payload(size, 1)
            assert tier.counters["errors"] == 0

    try:
        asyncio.run(body())
    finally:
        client.close()


@pytest.mark.parametrize("transport", ["resp", "redis-py", "cluster"])
def test_a_planted_object_with_a_lying_header_is_never_served_and_a_provable_one_is_replaced(
    redis_server: RedisServer, redis_cluster: RedisClusterServers, transport: str
) -> None:
    """Objects planted where a block belongs, one per reason a reader refuses: SET NX leaves
    each (a duplicate); the read refuses it (a miss, never the planted bytes); one whose damage
    is provable is deleted and the next put writes the block, one of another namespace or
    format version (a neighbour's) stays and is never replaced."""
    server: RedisServer | RedisClusterServers = (
        redis_cluster if transport == "cluster" else redis_server
    )
    flush(server)
    size = 4096
    raw = raw_client(server)

    async def body() -> None:
        async with RedisTier(namespace=NAMESPACE, **options(server, transport)) as tier:
            planted = {}
            for i, reason in enumerate(corrupt_variants(tier, key(0), payload(size, 0))):
                blob = corrupt_variants(tier, key(i), payload(size, i))[reason]
                raw.set(name(key(i)), blob)
                planted[i] = (reason, blob)
            items = [(key(i), payload(size, i)) for i in planted]
            assert await tier.put_many(items) == [None] * len(items)
            assert tier.counters["duplicates"] == len(items)
            buffers = [bytearray(size) for _ in planted]
            found = await tier.get_many(
                [(key(i), b) for i, b in zip(planted, buffers, strict=True)]
            )
            assert found == [False] * len(planted)
            assert await tier.put_many(items) == [None] * len(items)
            for i, (reason, blob) in planted.items():
                kept = raw.get(name(key(i)))
                if reason in ("namespace", "version"):
                    assert kept == blob, reason  # a neighbour's: left, and not replaced
                    assert await tier.get(key(i), bytearray(size)) is False
                else:
                    assert await tier.get_bytes(key(i), size) == payload(size, i), reason
            assert tier.counters["errors"] == 0

    try:
        asyncio.run(body())
    finally:
        raw.close()


@pytest.fixture
def dying(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of the test's own that it may kill: durable, so that what it acknowledged is
    there after a restart."""
    server = RedisServer(tmp_path / "redis", durable=True)
    server.start()
    yield server
    server.stop()


def kill_when(server: RedisServer, started: Callable[[redis.Redis], bool]) -> threading.Thread:
    """A thread that kills the server (SIGKILL) as soon as `started` says, from a connection of
    its own polled every half millisecond, that the batch is under way: caught in flight."""
    admin = redis.Redis(host="127.0.0.1", port=server.port)

    def kill() -> None:
        deadline = time.monotonic() + 10
        while not started(admin) and time.monotonic() < deadline:
            time.sleep(0.0005)
        admin.close()
        server.stop()

    thread = threading.Thread(target=kill)
    thread.start()
    return thread


def output_bytes(admin: redis.Redis) -> int:
    return int(admin.info("stats")["total_net_output_bytes"])


@pytest.mark.parametrize("transport", ["resp", "redis-py"])
def test_a_server_that_goes_away_mid_pipeline_fails_the_rest_and_tears_nothing(
    dying: RedisServer, transport: str
) -> None:
    """The server killed while a 48 MiB batch of SET NX and then one of GETs are on the wire:
    each batch returns within its deadline, every block failed is a counted `TierError`
    (never another exception), every block read is the right one, and after a restart every
    block the server acknowledged is there, whole."""
    n, size = 96, 512 << 10
    items = [(key(i), payload(size, i)) for i in range(n)]

    async def body() -> None:
        tier = RedisTier(namespace=NAMESPACE, timeout=5.0, **options(dying, transport))
        async with tier:
            await tier.contains([key(0)])
            killer = kill_when(dying, lambda admin: admin.dbsize() > 0)  # some SETs landed
            start = time.monotonic()
            outcomes = await tier.put_many(items)
            took = time.monotonic() - start
            killer.join()
            failed = [o for o in outcomes if o is not None]
            assert failed and all(isinstance(o, TierError) for o in failed), outcomes
            assert took < 6.0 and tier.counters["errors"] == len(failed)
            acknowledged = [i for i, o in enumerate(outcomes) if o is None]
            await asyncio.to_thread(dying.start)
            buffers = [bytearray(size) for _ in range(n)]
            found = await tier.get_many([(key(i), b) for i, b in enumerate(buffers)])
            assert all(found[i] is True for i in acknowledged), found
            assert all(
                bytes(buffers[i]) == payload(size, i) for i, f in enumerate(found) if f is True
            )
            await tier.put_many(items)  # every block, for the read below
            errors = tier.counters["errors"]
            admin = redis.Redis(host="127.0.0.1", port=dying.port)
            before = output_bytes(admin)
            admin.close()
            killer = kill_when(dying, lambda admin: output_bytes(admin) > before + (1 << 20))
            buffers = [bytearray(size) for _ in range(n)]
            found = await tier.get_many([(key(i), b) for i, b in enumerate(buffers)])
            killer.join()
            lost = [f for f in found if f is not True]
            assert lost and all(isinstance(f, TierError) for f in lost), found
            assert all(
                bytes(buffers[i]) == payload(size, i) for i, f in enumerate(found) if f is True
            )
            assert tier.counters["errors"] > errors
            assert not any(c.startswith("corrupt") for c in tier.counters), tier.counters

    asyncio.run(body())


def test_a_fast_path_tier_pointed_at_a_cluster_node_says_to_set_cluster(
    redis_cluster: RedisClusterServers,
) -> None:
    """Without `cluster: true`, a Cluster node answers MOVED for the keys it does not serve:
    counted errors that say what to set, never a crash, and the keys it serves still work."""
    flush(redis_cluster)

    async def body() -> None:
        async with RedisTier(namespace=NAMESPACE, url=redis_cluster.nodes[0].url) as tier:
            assert tier._fast is not None
            outcomes = await tier.put_many([(key(i), payload(1024, i)) for i in range(12)])
            moved = [o for o in outcomes if o is not None]
            assert moved and all("set cluster: true" in str(o) for o in moved), outcomes
            assert tier.counters["errors"] == len(moved)
            found = await tier.get_many([(key(i), bytearray(1024)) for i in range(12)])
            assert [f is True for f in found] == [o is None for o in outcomes]
            assert all(isinstance(f, TierError) for f in found if f is not True)

    asyncio.run(body())


# -- a slot moving during a batch -----------------------------------------------------------------


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[RedisClusterServers]:
    """A cluster of the test's own: its slots are moved about."""
    cluster = RedisClusterServers(tmp_path / "cluster")
    cluster.start()
    yield cluster
    cluster.stop()


class SlotMover:
    """A thread moving slots between a Cluster's masters, with their keys, the way `redis-cli
    --cluster reshard` does (IMPORTING, MIGRATING, MIGRATE, SETSLOT NODE): while a slot
    moves, its keys answer ASK; once moved, MOVED."""

    def __init__(self, cluster: RedisClusterServers, slots: list[int]) -> None:
        self.clients = [redis.Redis(host="127.0.0.1", port=n.port) for n in cluster.nodes]
        self.ports = [n.port for n in cluster.nodes]
        self.ids = [c.execute_command("CLUSTER", "MYID").decode() for c in self.clients]
        self.slots = slots
        self.moves = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run)

    def owner(self, slot: int) -> int:
        for start, end, master, *_ in self.clients[0].execute_command("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                return self.ports.index(master[1])
        raise AssertionError(f"slot {slot} has no owner")

    def move(self, slot: int, source: int, target: int) -> None:
        src, dst = self.clients[source], self.clients[target]
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", self.ids[source])
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", self.ids[target])
        while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 50):
            time.sleep(0.005)  # the batch meets the slot half moved: ASK
            src.execute_command(
                "MIGRATE", "127.0.0.1", self.ports[target], "", 0, 5000, "REPLACE", "KEYS", *keys
            )
        for client in (dst, src, *(c for c in self.clients if c not in (src, dst))):
            client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", self.ids[target])
        self.moves += 1

    def run(self) -> None:
        while not self.stop.is_set():
            for slot in self.slots:
                source = self.owner(slot)
                self.move(slot, source, (source + 1) % len(self.clients))

    def __enter__(self) -> SlotMover:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        for client in self.clients:
            client.close()


def test_a_slot_moving_during_batches_of_set_nx_is_followed_or_a_counted_error(
    own_cluster: RedisClusterServers,
) -> None:
    """Batches of SET NX and GETs while the slots of their keys move from master to master
    (ASK mid-move, MOVED after): every outcome is a success or a counted `TierError`, every
    batch ends within its deadline, nothing read is a wrong block; once the slots rest, every
    block is written and reads back whole."""
    n, size = 48, 16 << 10
    probe = redis.Redis(host="127.0.0.1", port=own_cluster.nodes[0].port)
    slots = sorted(
        {int(probe.execute_command("CLUSTER", "KEYSLOT", name(key(i)))) for i in range(n)}
    )
    probe.close()
    items = [(key(i), payload(size, i)) for i in range(n)]

    async def body() -> None:
        async with RedisTier(
            namespace=NAMESPACE, url=own_cluster.url, cluster=True, timeout=10.0
        ) as tier:
            mover = SlotMover(own_cluster, slots[:12])
            with mover:
                deadline = time.monotonic() + 6
                rounds = 0
                while time.monotonic() < deadline and (mover.moves < 24 or rounds < 5):
                    start = time.monotonic()
                    outcomes = await tier.put_many(items)
                    assert all(o is None or isinstance(o, TierError) for o in outcomes), outcomes
                    buffers = [bytearray(size) for _ in range(n)]
                    found = await tier.get_many(
                        [(k, b) for (k, _), b in zip(items, buffers, strict=True)]
                    )
                    assert time.monotonic() - start < 11
                    for i, f in enumerate(found):
                        assert f is False or f is True or isinstance(f, TierError), f
                        if f is True:
                            assert bytes(buffers[i]) == payload(size, i)
                    rounds += 1
            assert mover.moves >= 12, mover.moves
            assert await tier.put_many(items) == [None] * n
            buffers = [bytearray(size) for _ in range(n)]
            found = await tier.get_many([(k, b) for (k, _), b in zip(items, buffers, strict=True)])
            assert found == [True] * n
            assert all(bytes(b) == payload(size, i) for i, b in enumerate(buffers))
            assert not any(c.startswith("corrupt") for c in tier.counters), tier.counters

    asyncio.run(body())
