"""`Tier.usage` against what a stranger can put in a shared store: only what kvtier names as a
block or a pack counts, nothing planted costs more than a stat or a bounded read, and a
deadline stops a listing (real directory, redis-server, SeaweedFS)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
import redis

from kvtier.servers import RedisServer, SeaweedS3
from tiering.errors import TierTimeout
from tiering.keys import BlockKey, make_key
from tiering.tier import NamespaceUsage
from tiering.tier.usage import UsageTally
from tiers.file import BlockFileTier, SegmentFileTier
from tiers.file.usage import FileUsage
from tiers.redis import RedisTier
from tiers.s3 import S3Tier

NS = bytes(range(16))
PROBE = bytes(16)
SIZE = 4096


def k(i: int) -> BlockKey:
    return make_key(i.to_bytes(32, "big"))


def summary(usage: list[NamespaceUsage]) -> dict[str, tuple[int, int]]:
    return {u.namespace.hex(): (u.objects, u.bytes_used) for u in usage}


@pytest.mark.parametrize("cls", [BlockFileTier, SegmentFileTier])
def test_a_directory_counts_only_kvtier_objects(
    tmp_path: Path, cls: type[BlockFileTier] | type[SegmentFileTier]
) -> None:
    async def go() -> dict[str, tuple[int, int]]:
        async with cls(namespace=NS, path=tmp_path, min_free=0) as tier:
            await tier.put_many([(k(i), bytes(SIZE)) for i in range(3)])
        root = tmp_path / NS.hex()
        os.mkfifo(root / "00000099.kvs")  # a FIFO named like a segment: never opened
        (root / "ab" / "cd").mkdir(parents=True, exist_ok=True)
        os.mkfifo(root / "ab" / "cd" / (k(7).hex() + ".kv"))  # and like an object
        (root / "ab" / "cd" / ("zz" + k(8).hex()[2:] + ".kv")).write_bytes(b"junk")
        (root / "ab" / "cd" / f".{k(9).hex()}.kv.1.0.tmp").write_bytes(b"a write in flight")
        (root / "ab" / "loop").symlink_to(tmp_path)  # never followed
        (tmp_path / NS.hex().upper()).mkdir()  # not kvtier's spelling of a namespace
        (tmp_path / ("f" * 32)).symlink_to(root)  # a link to a namespace: not followed
        async with cls(namespace=PROBE, path=tmp_path, min_free=0, read_only=True) as probe:
            return summary(await probe.usage(timeout=10))

    found = asyncio.run(go())
    assert list(found) == [NS.hex()] and found[NS.hex()][0] == 3


def test_a_deadline_stops_a_directory_scan(tmp_path: Path) -> None:
    """A listing past its deadline raises TierTimeout, and the pool's thread stops at its next
    entry instead of scanning on (the tier closes at once)."""
    for i in range(40):
        (tmp_path / NS.hex() / f"{i:02x}" / "00").mkdir(parents=True)

    async def go() -> float:
        async with BlockFileTier(namespace=NS, path=tmp_path, min_free=0) as tier:
            scan: FileUsage = tier._usage_scan
            slow = scan._call

            async def slowed(function: object, *args: object) -> object:
                await asyncio.sleep(0.05)  # every directory takes a while
                return await slow(function, *args)  # type: ignore[arg-type]

            scan._call = slowed  # type: ignore[method-assign]
            with pytest.raises(TierTimeout, match="usage not listed within 0.2s"):
                await tier.usage(timeout=0.2)
            assert tier.counters["errors"] == 0  # not the data path's
            began = time.monotonic()
        return time.monotonic() - began

    assert asyncio.run(go()) < 1.0


@pytest.mark.redis
def test_redis_counts_only_kvtier_names(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()

    async def go() -> dict[str, tuple[int, int]]:
        async with RedisTier(namespace=NS, url=redis_server.url) as tier:
            await tier.put_many([(k(i), bytes(SIZE)) for i in range(3)])
        client.set(b"kvtier:xyz", b"1")
        client.set(b"kvtier:" + NS.hex().encode() + b":not-a-key", b"1")
        client.set(b"kvtier:" + ("e" * 32).encode(), b"nan")  # a marker alone: no objects
        client.set(b"kvtier:" + NS.hex().upper().encode() + b":" + k(1).hex().encode(), b"1")
        client.set(b"kvtier:" + NS.hex().encode(), b"9" * (1 << 20))  # read 64 bytes of it
        client.rpush(b"kvtier:" + NS.hex().encode() + b":" + k(5).hex().encode(), b"x")
        async with RedisTier(namespace=PROBE, url=redis_server.url, read_only=True) as probe:
            return summary(await probe.usage(timeout=10))

    try:
        found = asyncio.run(go())
    finally:
        client.flushall()
        client.close()
    assert list(found) == [NS.hex()]
    assert found[NS.hex()][0] == 4  # the planted list under a block's name is an object


@pytest.mark.redis
def test_redis_usage_scans_the_keyspace_once_however_many_namespaces_lack_a_marker(
    redis_server: RedisServer,
) -> None:
    """Namespaces written before writers kept a marker (or whose marker was evicted): their
    last access comes from the same SCAN (each block's idle time beside its size), not from
    one more SCAN of the whole keyspace per namespace."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    namespaces = [bytes([n]) * 16 for n in range(1, 9)]
    for n in namespaces:
        for i in range(3):
            client.set(b"kvtier:" + n.hex().encode() + b":" + k(i).hex().encode(), b"x" * 10)
    for i in range(2000):  # the rest of a busy server's keyspace
        client.set(f"other:{i}".encode(), b"1")
    client.config_resetstat()

    async def go() -> list[NamespaceUsage]:
        async with RedisTier(namespace=PROBE, url=redis_server.url, read_only=True) as probe:
            return await probe.usage(timeout=30)

    try:
        usage = asyncio.run(go())
        scans = client.info("commandstats").get("cmdstat_scan", {}).get("calls", 0)
    finally:
        client.flushall()
        client.close()
    assert sorted(u.namespace for u in usage) == sorted(namespaces)
    assert all(u.objects == 3 and u.last_write is not None for u in usage)
    one_pass = -(-2024 // 1000) + 2  # the SCAN's pages over the keyspace, and a margin
    assert scans <= one_pass, scans


@pytest.mark.s3
def test_s3_counts_only_kvtier_names_and_bounds_a_planted_pack(s3_server: SeaweedS3) -> None:
    prefix = f"usage-attack-{time.monotonic_ns()}/"
    client = s3_server.client()
    base = f"{prefix}{NS.hex()}/"
    kw = {
        "bucket": s3_server.bucket,
        "prefix": prefix,
        "endpoint_url": s3_server.endpoint,
        "access_key": s3_server.ACCESS_KEY,
        "secret_key": s3_server.SECRET_KEY,
    }

    async def go() -> dict[str, tuple[int, int]]:
        async with S3Tier(namespace=NS, **kw) as tier:
            await tier.put_many([(k(i), bytes(SIZE)) for i in range(3)])
        for name, body in (
            (f"{prefix}junk", b"x"),
            (f"{prefix}{'e' * 32}/zz/{k(1).hex()}", b"x"),  # a key outside its fan-out prefix
            (f"{prefix}lease", b"x"),
            (f"{base}ab/not-a-key", b"x"),
            (f"{base}packs/claims-a-gibibyte", (1 << 30).to_bytes(4, "big") + b"{}"),
            (f"{base}packs/not-json", (5).to_bytes(4, "big") + b"{{{{{"),
        ):
            client.put_object(Bucket=s3_server.bucket, Key=name, Body=body)  # type: ignore[attr-defined]
        async with S3Tier(namespace=PROBE, read_only=True, **kw) as probe:
            first = summary(await probe.usage(timeout=30))
            assert summary(await probe.usage(timeout=30)) == first  # and from its cache
            return first

    found = asyncio.run(go())
    assert list(found) == [NS.hex()]
    objects, size = found[NS.hex()]
    assert objects == 3 and size > 3 * SIZE  # the planted packs: their bytes, no block


def test_a_tally_keeps_a_bounded_number_of_namespaces() -> None:
    tally = UsageTally(limit=3)
    for i in range(10):
        tally.add(bytes([i]) * 16, 100, float(i))
    tally.written(bytes([9]) * 16, 5.0)  # beyond the bound: not kept either
    assert [u.namespace[0] for u in tally.result("t")] == [0, 1, 2] and tally.dropped == 7


def test_a_wrapped_tier_lists_its_store(tmp_path: Path) -> None:
    """`FaultyTier` (any `ForwardingTier`) lists what the tier it wraps lists."""
    from tiering.tier.wrappers import FaultyTier

    async def go() -> dict[str, tuple[int, int]]:
        async with BlockFileTier(namespace=NS, path=tmp_path, min_free=0) as tier:
            await tier.put_many([(k(i), bytes(SIZE)) for i in range(2)])
        inner = BlockFileTier(namespace=PROBE, path=tmp_path, min_free=0, read_only=True)
        async with FaultyTier(inner) as wrapped:
            return summary(await wrapped.usage(timeout=10))

    assert asyncio.run(go()) == {NS.hex(): (2, 2 * 8192)}
