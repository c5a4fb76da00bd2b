"""`kvtier stats` and `kvtier purge --idle-for` on every tier type's real store: a directory
(both layouts), redis-server, a Redis Cluster, SeaweedFS with and without packs."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from kvtier.cli import main
from kvtier.servers import RedisClusterServers, RedisServer, SeaweedS3
from tiering.config import parse_config, tier_from_config
from tiering.keys import BlockKey, make_key
from tiering.testing import payload

pytestmark = [pytest.mark.redis, pytest.mark.s3]

OLD = bytes(range(1, 17))
"""The namespace of a model nobody runs any more: written first, then never again."""
NEW = bytes(range(50, 66))
"""A namespace in use: written after OLD, within the idle time."""
SIZE = 8192
IDLE = 3.0
"""Seconds between the two namespaces' writes."""
KINDS = ["files", "segments", "redis", "redis-cluster", "s3", "s3-packs"]


def k(i: int) -> BlockKey:
    return make_key(i.to_bytes(32, "big"))


class Store:
    """One tier of a kind over a store of its own: its YAML entry and raw peeks at it."""

    def __init__(self, kind: str, entry: dict[str, Any], peek: Callable[[], Any]) -> None:
        self.kind = kind
        self.entry = entry
        self.peek = peek

    def tier(self, namespace: bytes) -> Any:
        config = parse_config({"tiers": [self.entry]})
        return tier_from_config(config.tiers[0], namespace, config)

    def fill(self, namespace: bytes, ids: range) -> None:
        async def go() -> None:
            async with self.tier(namespace) as tier:
                await tier.put_many([(k(i), payload(SIZE, i)) for i in ids])

        asyncio.run(go())

    def blocks(self, namespace: bytes, ids: range) -> list[bool]:
        async def go() -> list[bool]:
            async with self.tier(namespace) as tier:
                return [await tier.get_bytes(k(i), SIZE) == payload(SIZE, i) for i in ids]

        return asyncio.run(go())


@pytest.fixture
def store(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    redis_server: RedisServer,
    s3_server: SeaweedS3,
) -> Iterator[Store]:
    kind: str = request.param
    if kind in ("files", "segments"):
        path = tmp_path / "nvme"
        entry: dict[str, Any] = {"name": "t", "type": "file", "path": str(path), "min_free": 0}
        if kind == "segments":
            entry["layout"] = "segments"
        yield Store(kind, entry, lambda: sorted(p.name for p in path.rglob("*") if p.is_file()))
        return
    if kind.startswith("redis"):
        if kind == "redis":
            url, cluster = redis_server.url, False
            client: Any = redis.Redis.from_url(url)
        else:
            cluster_servers: RedisClusterServers = request.getfixturevalue("redis_cluster")
            url, cluster = cluster_servers.url, True
            client = redis.RedisCluster.from_url(url)
        client.flushall()
        entry = {"name": "t", "type": "redis", "url": url, "cluster": cluster}
        yield Store(kind, entry, lambda: sorted(client.scan_iter(match="kvtier:*")))
        client.flushall()
        client.close()
        return
    prefix = f"usage-{time.monotonic_ns()}/"
    entry = {
        "name": "t",
        "type": "s3",
        "bucket": s3_server.bucket,
        "prefix": prefix,
        "endpoint_url": s3_server.endpoint,
        "access_key": s3_server.ACCESS_KEY,
        "secret_key": s3_server.SECRET_KEY,
        "blocks_per_object": 4 if kind == "s3-packs" else 1,
    }
    client = s3_server.client()
    yield Store(
        kind,
        entry,
        lambda: sorted(
            o["Key"]
            for o in client.list_objects_v2(Bucket=s3_server.bucket, Prefix=prefix).get(
                "Contents", []
            )
        ),
    )


def kvtier(config: Path, *args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main([args[0], "--config", str(config), *args[1:]])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("store", KINDS, indirect=True)
def test_stats_lists_every_namespace_and_purge_takes_the_idle_one(
    store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "kvtier.yaml"
    config.write_text(json.dumps({"tiers": [store.entry | {"capacity": "1GiB"}]}))
    began = time.time()
    store.fill(OLD, range(0, 3))
    old_end = time.time()
    time.sleep(IDLE)
    new_start = time.time()
    store.fill(NEW, range(10, 15))
    capsys.readouterr()

    def between() -> str:
        """An idle time between the two namespaces' ages now, whatever the commands took (a
        second either side: S3 times writes to the second)."""
        now = time.time()
        return f"{round(1000 * ((now - old_end) + (now - new_start + 1)) / 2)}ms"

    code, out, err = kvtier(config, "stats", "--json", capsys=capsys)
    assert code == 0, err
    rows = {row["namespace"]: row for row in json.loads(out)}
    assert set(rows) == {OLD.hex(), NEW.hex()}
    old, new = rows[OLD.hex()], rows[NEW.hex()]
    assert (old["objects"], new["objects"]) == (3, 5)
    assert 3 * SIZE <= old["bytes"] < 3 * (SIZE + 8192) and 5 * SIZE <= new["bytes"]
    assert old["store_objects"] == 8 and old["store_bytes"] == old["bytes"] + new["bytes"]
    assert old["capacity"] == 1 << 30
    assert began - 1 <= old["last_write"] <= old_end + 0.5
    assert new_start - 1 <= new["last_write"] <= time.time() + 0.5
    code, table, _ = kvtier(config, "stats", capsys=capsys)
    assert code == 0 and OLD.hex() in table and "(store total)" in table
    assert "1,073,741,824" in table

    before = store.peek()
    code, out, err = kvtier(config, "purge", "--tier", "t", "--idle-for", between(), capsys=capsys)
    assert code == 0, err
    assert "would purge 1 namespaces" in out and OLD.hex() in out and NEW.hex() not in out
    assert store.peek() == before  # the dry run changed nothing

    code, out, err = kvtier(
        config,
        "purge",
        "--tier",
        "t",
        "--idle-for",
        between(),
        "--yes",
        "--force",
        "--json",
        capsys=capsys,
    )
    assert code == 0, err
    done = json.loads(out)
    assert done["purged"] == [{"namespace": OLD.hex(), "deleted": 3}] and done["deleted"] == 3
    assert not any(OLD.hex() in str(name) for name in store.peek())  # nothing of it left
    assert store.blocks(NEW, range(10, 15)) == [True] * 5  # the fresh one is whole
    code, out, _ = kvtier(config, "stats", "--json", capsys=capsys)
    assert [row["namespace"] for row in json.loads(out)] == [NEW.hex()]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--idle-for", "soon"], "--idle-for: expected a duration like '200ms' or '1h'"),
        (["--idle-for", "0"], "--idle-for: must be positive"),
        (["--idle-for=-3d"], "--idle-for: expected a duration"),
        (["--idle-for", "1000y"], "--idle-for: expected a duration"),
        (["--idle-for", "30d", "--namespace", "xyz"], "--namespace: expected 32 hex digits"),
        (["--idle-for", "٣d", "--yes"], "--idle-for: expected a duration like '200ms' or '1h'"),
        (["--idle-for", "３0d"], "--idle-for: expected a duration like '200ms' or '1h'"),
        (["--idle-for", "1ms", "--yes"], "--idle-for: 1ms is under 1h, shorter than an engine"),
        (["--idle-for", "59m", "--yes"], "add --force to purge anyway"),
    ],
)
def test_bad_idle_for_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    config = tmp_path / "kvtier.yaml"
    config.write_text(f"tiers: [{{name: t, type: file, path: '{tmp_path / 'd'}'}}]\n")
    code, _, err = kvtier(config, "purge", "--tier", "t", *args, capsys=capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_purge_idle_refuses_a_read_only_tier(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "d"
    store = Store("files", {"name": "t", "type": "file", "path": str(path), "min_free": 0}, list)
    store.fill(OLD, range(2))
    config = tmp_path / "kvtier.yaml"
    config.write_text(f"tiers: [{{name: t, type: file, path: '{path}', read_only: true}}]\n")
    code, _, err = kvtier(
        config, "purge", "--tier", "t", "--idle-for", "1s", "--yes", capsys=capsys
    )
    assert code == 2 and "tier 't' is read-only" in err
    assert store.blocks(OLD, range(2)) == [True, True]


def test_purge_idle_of_one_namespace_and_within_older_than(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--namespace` takes that namespace only, when it is idle; `--older-than` keeps its
    younger blocks (file tiers record each object's time)."""
    path = tmp_path / "d"
    entry = {"name": "t", "type": "file", "path": str(path), "min_free": 0}
    store = Store("files", entry, list)
    store.fill(OLD, range(4))
    store.fill(NEW, range(4))
    config = tmp_path / "kvtier.yaml"
    config.write_text(json.dumps({"tiers": [entry]}))
    old_files = sorted((path / OLD.hex()).rglob("*.kv"))
    week = time.time() - 8 * 86400
    for f in old_files[:3]:  # three written eight days ago, the last a day later
        os.utime(f, (week, week))
    os.utime(old_files[3], (week + 86400, week + 86400))
    for f in (path / NEW.hex()).rglob("*.kv"):
        os.utime(f, (week, week))
    code, out, err = kvtier(
        config,
        "purge",
        "--tier",
        "t",
        "--idle-for",
        "5d",
        "--namespace",
        OLD.hex(),
        "--older-than",
        "180h",
        "--yes",
        "--json",
        capsys=capsys,
    )
    assert code == 0, err
    assert json.loads(out)["purged"] == [{"namespace": OLD.hex(), "deleted": 3}]
    assert [f.exists() for f in old_files] == [False, False, False, True]
    assert store.blocks(NEW, range(4)) == [True] * 4  # idle too, but not the one named


def test_a_namespace_whose_last_write_is_unknown_is_kept(
    redis_server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Redis without the marker (blocks of an older kvtier): the last access stands in
    (OBJECT IDLETIME, which neither the listing nor MEMORY USAGE touches); under an LFU
    policy the server keeps none, and the namespace is never taken for idle."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    entry = {"name": "t", "type": "redis", "url": redis_server.url}
    store = Store("redis", entry, list)
    store.fill(OLD, range(3))
    client.delete(b"kvtier:" + OLD.hex().encode())
    config = tmp_path / "kvtier.yaml"
    config.write_text(json.dumps({"tiers": [entry]}))
    time.sleep(2.2)
    for _ in range(2):  # a listing leaves the blocks' idle time as it was
        code, out, _ = kvtier(config, "stats", "--json", capsys=capsys)
        (row,) = json.loads(out)
        assert code == 0 and row["objects"] == 3 and 1.5 <= row["idle_seconds"] < 60
    for name in client.scan_iter(match=f"kvtier:{OLD.hex()}:*"):
        assert client.object("idletime", name) >= 2
    policy = client.config_get("maxmemory-policy")["maxmemory-policy"]
    try:
        client.config_set("maxmemory-policy", "allkeys-lfu")
        code, out, _ = kvtier(
            config, "purge", "--tier", "t", "--idle-for", "1s", "--yes", "--force", capsys=capsys
        )
        assert code == 0 and "purged 0 namespaces" in out and "cannot tell: " + OLD.hex() in out
        assert store.blocks(OLD, range(3)) == [True] * 3
    finally:
        client.config_set("maxmemory-policy", policy)
        client.flushall()
        client.close()
