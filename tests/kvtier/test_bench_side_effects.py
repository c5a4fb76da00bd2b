"""`kvtier bench` leaves every tier as it found it (issue 15, item 12): it works in scratch space
of its own (a new directory, a Redis key prefix and a namespace of its own, an S3 prefix) and
removes it, also when it fails; a user's `baseline` directory, `key:*` keys and
`kvtier-baseline/*` objects, and their blocks, are never touched."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import kvtier.baselines
from kvtier.cli import main
from kvtier.servers import RedisServer, SeaweedS3
from tiering.testing import NAMESPACE, key, payload
from tiering.tier import Tier
from tiers.file import FileTier
from tiers.redis import RedisTier
from tiers.s3 import S3Tier

SIZE = 16 << 10


def bench(config: Path, tier: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(
        ["bench", "--config", str(config), "--tier", tier, "--sizes", "16KiB", "--count", "24"]
    )
    out = capsys.readouterr()
    return code, out.out + out.err


def put_user_block(tier: Tier) -> None:
    async def body() -> None:
        async with tier:
            await tier.put(key(7), payload(SIZE, 7))

    asyncio.run(body())


@pytest.fixture(params=["ok", "fails"])
def outcome(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """`fails`: the bench fails mid-way, its puts done and its gets not (the harness's second
    timed phase raises): what it wrote must go all the same."""
    if request.param == "fails":
        real = kvtier.baselines.timed
        calls = 0

        async def failing(calls_: Any, in_flight: int) -> float:
            nonlocal calls
            calls += 1
            if calls == 2:
                raise KeyboardInterrupt  # a user's Ctrl-C, the hardest to clean up after
            return await real(calls_, in_flight)

        monkeypatch.setattr(kvtier.baselines, "timed", failing)
    return str(request.param)


def check(code: int, out: str, outcome: str) -> None:
    if outcome == "ok":
        assert code == 0, out
    else:
        assert code == 130 and "interrupted" in out, out


# -- file ----------------------------------------------------------------------------------------


def snapshot_tree(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
        for p in sorted(root.rglob("*"))
    }


@pytest.mark.parametrize("layout", ["files", "segments"])
def test_a_file_bench_leaves_the_directory_as_it_was(
    tmp_path: Path, layout: str, outcome: str, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "nvme"
    (root / "baseline").mkdir(parents=True)
    (root / "baseline" / "mine.txt").write_text("a user's file")
    put_user_block(FileTier.variant({"layout": layout})(namespace=NAMESPACE, path=root, min_free=0))
    config = tmp_path / "tiers.yaml"
    config.write_text(
        "version: 1\nprimary: {capacity: 1GiB}\ntiers:\n"
        f'  - {{name: nvme, type: file, path: "{root}", min_free: 0, layout: {layout}}}\n'
    )
    before = snapshot_tree(root)
    code, out = bench(config, "nvme", capsys)
    check(code, out, outcome)
    assert snapshot_tree(root) == before


def test_a_file_bench_removes_the_directories_it_had_to_create(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "tiers.yaml"
    config.write_text(
        "version: 1\nprimary: {capacity: 1GiB}\ntiers:\n"
        f'  - {{name: nvme, type: file, path: "{tmp_path / "new" / "nvme"}", min_free: 0}}\n'
    )
    code, out = bench(config, "nvme", capsys)
    assert code == 0, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiers.yaml"]


def test_a_file_tier_too_small_for_the_bench_fails_in_one_line_and_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its capacity evicts blocks the gets then miss: an error naming the cause, not an
    AssertionError, and the directory as it was."""
    root = tmp_path / "nvme"
    root.mkdir()
    config = tmp_path / "tiers.yaml"
    config.write_text(
        "version: 1\nprimary: {capacity: 1GiB}\ntiers:\n"
        f'  - {{name: nvme, type: file, path: "{root}", min_free: 0, capacity: 64KiB}}\n'
    )
    code, out = bench(config, "nvme", capsys)
    assert code == 1 and "gets of 16384-byte blocks hit" in out and "capacity" in out, out
    assert "internal error" not in out
    assert list(root.iterdir()) == []


def test_blocks_of_256_mib_and_more_are_benched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Any size --sizes accepts runs: from 256 MiB on, making the bench's blocks ended the
    command in `internal error: OverflowError` (Python's `randbytes` draws at most 2**31 bits)."""
    config = tmp_path / "tiers.yaml"
    config.write_text("version: 1\ntiers:\n  - {name: m, type: memory, capacity: 1GiB}\n")
    args = ["--sizes", "256MiB", "--count", "1", "--clients", "1", "--json"]
    code = main(["bench", "--config", str(config), "--tier", "m", *args])
    out = capsys.readouterr()
    assert code == 0, out.err
    (row,) = json.loads(out.out)
    assert row["block_bytes"] == 256 << 20 and row["put_gib_s"] > 0 and row["get_gib_s"] > 0


def test_a_file_bench_with_fewer_blocks_than_clients_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--count below --clients: the raw baseline ran fio with streams of less than a block,
    which fio refuses (`internal error: CalledProcessError`); now one stream per block."""
    root = tmp_path / "nvme"
    root.mkdir()
    config = tmp_path / "tiers.yaml"
    config.write_text(
        f'version: 1\ntiers:\n  - {{name: nvme, type: file, path: "{root}", min_free: 0}}\n'
    )
    args = ["--sizes", "64KiB", "--count", "2", "--clients", "8", "--json"]
    code = main(["bench", "--config", str(config), "--tier", "nvme", *args])
    out = capsys.readouterr()
    assert code == 0, out.err
    (row,) = json.loads(out.out)
    assert row["raw_write_gib_s"] > 0 and row["raw_read_gib_s"] > 0, row


# -- redis ---------------------------------------------------------------------------------------


def snapshot_redis(client: redis.Redis) -> dict[bytes, Any]:
    return {name: client.dump(name) for name in sorted(client.scan_iter(count=1000))}


@pytest.mark.redis
def test_a_redis_bench_leaves_the_server_as_it_was(
    redis_server: RedisServer, tmp_path: Path, outcome: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """redis-benchmark's own default keys (`key:<12 digits>`) and a user's `key:1` survive,
    and neither the bench's blocks nor its baseline's keys remain."""
    client = redis.Redis(host="127.0.0.1", port=redis_server.port)
    client.flushall()
    client.set("key:1", b"a user's value")
    client.set("key:000000000001", b"looks like redis-benchmark's, is a user's")
    put_user_block(RedisTier(namespace=NAMESPACE, url=redis_server.url))
    config = tmp_path / "tiers.yaml"
    config.write_text(
        "version: 1\nprimary: {capacity: 1GiB}\ntiers:\n"
        f'  - {{name: redis, type: redis, url: "{redis_server.url}"}}\n'
    )
    before = snapshot_redis(client)
    code, out = bench(config, "redis", capsys)
    check(code, out, outcome)
    assert snapshot_redis(client) == before
    client.close()


@pytest.mark.redis
def test_a_redis_bench_that_the_server_refuses_leaves_the_server_as_it_was(
    redis_server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real failure mid-bench: the server runs out of memory partway through the puts."""
    client = redis.Redis(host="127.0.0.1", port=redis_server.port)
    client.flushall()
    client.set("key:1", b"a user's value")
    config = tmp_path / "tiers.yaml"
    config.write_text(
        "version: 1\nprimary: {capacity: 1GiB}\ntiers:\n"
        f'  - {{name: redis, type: redis, url: "{redis_server.url}"}}\n'
    )
    before = snapshot_redis(client)
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", used + 8 * SIZE)
    try:
        code, out = bench(config, "redis", capsys)
    finally:
        client.config_set("maxmemory", 0)
    assert code == 1 and "OOM" in out, out
    assert snapshot_redis(client) == before
    client.close()


# -- s3 ------------------------------------------------------------------------------------------


@pytest.fixture
def s3_prefix() -> str:
    return f"bench-{time.monotonic_ns()}/"


def snapshot_bucket(server: SeaweedS3, prefix: str) -> dict[str, str]:
    client: Any = server.client()
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=server.bucket, Prefix=prefix)
    return {o["Key"]: o["ETag"] for page in pages for o in page.get("Contents", [])}


@pytest.fixture
def s3_config(s3_server: SeaweedS3, s3_prefix: str, tmp_path: Path) -> Iterator[Path]:
    config = tmp_path / "tiers.yaml"
    config.write_text(
        "version: 1\nprimary: {capacity: 1GiB}\ntiers:\n"
        f"  - {{name: s3, type: s3, bucket: {s3_server.bucket}, prefix: {s3_prefix}, "
        f'endpoint_url: "{s3_server.endpoint}", access_key: {s3_server.ACCESS_KEY}, '
        f"secret_key: {s3_server.SECRET_KEY}}}\n"
    )
    yield config


@pytest.mark.s3
def test_an_s3_bench_leaves_the_bucket_as_it_was(
    s3_server: SeaweedS3,
    s3_prefix: str,
    s3_config: Path,
    outcome: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A user's objects under the tier's prefix, `kvtier-baseline/0` (where the baseline used
    to write) among them, and the user's blocks survive; nothing of the bench's remains."""
    client: Any = s3_server.client()
    for name in ("kvtier-baseline/0", "mine.bin"):
        client.put_object(Bucket=s3_server.bucket, Key=s3_prefix + name, Body=b"a user's")
    make: Callable[[], Tier] = lambda: S3Tier(  # noqa: E731
        namespace=NAMESPACE,
        bucket=s3_server.bucket,
        prefix=s3_prefix,
        endpoint_url=s3_server.endpoint,
        access_key=s3_server.ACCESS_KEY,
        secret_key=s3_server.SECRET_KEY,
    )
    put_user_block(make())
    before = snapshot_bucket(s3_server, "")
    code, out = bench(s3_config, "s3", capsys)
    check(code, out, outcome)
    assert snapshot_bucket(s3_server, "") == before
