"""The manifest of use (`tiering.manager.manifest`, `tiering.manager.recorder`) and the warm start
that follows it: records on every tier (memory, both file layouts, a real redis-server, real
SeaweedFS), every bad manifest refused with nothing read from it, a manifest whose blocks every
tier has since lost (all skipped, counted, nothing read), and an engine identity clash."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.manager import Harness, k
from tests.helpers.manifests import THROUGH, file_tier, wait_for, warm
from tiering.config import TierConfig
from tiering.errors import CorruptObject
from tiering.keys import store_namespace
from tiering.manager.counters import (
    BLOCKS_WARMED,
    MANIFEST_CLASHES,
    WARM_PLANNED,
    WARM_SKIPPED,
)
from tiering.manager.manifest import (
    Manifest,
    ManifestRefused,
    clash,
    decode,
    encode,
    engine_identity,
    is_live,
    read_manifest,
    record_name,
)
from tiering.policies import ARCPolicy, LRUPolicy
from tiering.primary import KeyState
from tiering.testing import NAMESPACE
from tiering.tier import Tier
from tiering.tier.wrappers import ForwardingTier
from tiers.memory import MemoryTier

SECRET = b"s" * 32


@pytest.fixture(
    params=[
        "memory",
        "files",
        "segments",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("s3", marks=pytest.mark.s3),
    ]
)
def tier_of(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[bytes], Tier]:
    """A tier of the given namespace, every call's over one store."""
    kind = request.param
    if kind == "memory":
        return lambda namespace: MemoryTier(namespace=namespace)
    if kind in ("files", "segments"):
        return lambda namespace: file_tier(tmp_path, kind, namespace=namespace)
    if kind == "redis":
        from tiers.redis import RedisTier

        url = request.getfixturevalue("redis_server").url
        return lambda namespace: RedisTier(namespace=namespace, name="redis", url=url)
    from tiers.s3 import S3Tier

    server = request.getfixturevalue("s3_server")
    prefix = f"m{time.monotonic_ns()}/"
    return lambda namespace: S3Tier(
        namespace=namespace,
        name="s3",
        bucket=server.bucket,
        endpoint_url=server.endpoint,
        access_key=server.ACCESS_KEY,
        secret_key=server.SECRET_KEY,
        prefix=prefix,
    )


@pytest.fixture
def any_tier(tier_of: Callable[[bytes], Tier]) -> Tier:
    return tier_of(NAMESPACE)


def test_every_tier_keeps_a_record_apart_from_its_blocks(any_tier: Tier) -> None:
    """Written, replaced and read back whole; absent: None; never a block (no key listed, no
    object counted)."""

    async def run() -> None:
        async with any_tier as tier:
            name = f"manifest.t{time.monotonic_ns()}"
            assert await tier.read_record(name) is None
            assert await tier.write_record(name, b"first")
            assert await tier.write_record(name, b"second" * 1000)
            assert await tier.read_record(name) == b"second" * 1000
            assert (await tier.stat()).objects == 0
            if tier.supports_listing:
                assert [key async for key in tier.keys()] == []

    asyncio.run(run())


def test_every_tier_lists_its_records_by_prefix_and_removes_them(
    tier_of: Callable[[bytes], Tier],
) -> None:
    """Listed by prefix, sorted, bounded, this namespace's only; a removed one is gone."""

    mine = time.monotonic_ns().to_bytes(16, "big")  # namespaces no other test wrote in
    other = (time.monotonic_ns() + 1).to_bytes(16, "big")

    async def run() -> None:
        async with tier_of(mine) as tier, tier_of(other) as far:
            assert await tier.list_records("manifest.") == []
            for name in ("manifest.b", "manifest.a", "manifest-request.a", "other"):
                assert await tier.write_record(name, name.encode())
            await far.write_record("manifest.c", b"c")
            assert await tier.list_records("manifest.") == ["manifest.a", "manifest.b"]
            assert await tier.list_records("manifest.", limit=1) in (["manifest.a"], ["manifest.b"])
            assert len(await tier.list_records()) == 4
            assert await far.list_records("manifest.") == ["manifest.c"]
            assert await tier.delete_record("manifest.a")
            assert not await tier.delete_record("manifest.a")
            assert await tier.list_records("manifest.") == ["manifest.b"]
            assert await tier.read_record("manifest.a") is None
            if tier.supports_listing:
                assert [key async for key in tier.keys()] == []

    asyncio.run(run())


def manifest(engine: str = "e1", keys: int = 3, namespace: bytes = NAMESPACE) -> Manifest:
    return Manifest(namespace, engine, [k(i) for i in range(keys)], pid=1, session=7)


def test_a_manifest_is_read_back_as_written_and_costs_37_bytes_a_block() -> None:
    one, many = encode(manifest(keys=1)), encode(manifest(keys=1001))
    assert len(many) - len(one) == 1000 * 37
    back = decode(many, NAMESPACE, "e1")
    assert list(back.keys) == [k(i) for i in range(1001)]
    assert (back.pid, back.session, back.engine) == (1, 7, "e1")


def _version(data: bytes) -> bytes:
    return data[:8] + (3).to_bytes(2, "big") + data[10:]


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda d: d[:-40], "corrupt"),  # truncated: the digest is not the body's
        (lambda d: d[:12], "magic"),
        (lambda d: d[:60] + bytes([d[60] ^ 1]) + d[61:], "corrupt"),
        (_version, "version"),
        (lambda d: b"junk" + d, "magic"),
    ],
    ids=["truncated", "cut-short", "flipped", "version", "junk"],
)
def test_a_damaged_manifest_is_refused(damage: Callable[[bytes], bytes], reason: str) -> None:
    with pytest.raises(ManifestRefused) as refused:
        decode(damage(encode(manifest())), NAMESPACE, "e1")
    assert refused.value.reason == reason


def _format_1(data: bytes) -> bytes:
    """`data` (format 2) as format 1 wrote it: no interval, its own digest."""
    body = data[:8] + (1).to_bytes(2, "big") + data[10:-16]
    at = 10 + 16 + 1 + 2 + 1 + len(socket.gethostname().encode()[:255]) + 4 + 8 + 8 + 1
    body = body[:at] + body[at + 8 :]
    return body + hashlib.sha256(body).digest()[:16]


def test_a_manifest_carries_its_writers_interval_and_format_1_is_still_read() -> None:
    """Format 2 says the writer's interval; a format 1 manifest (an older kvtier's) reads back
    whole, its interval unknown."""
    data = encode(Manifest(NAMESPACE, "e1", [k(0), k(1)], pid=1, session=7, interval=300.0))
    assert decode(data, NAMESPACE, "e1").interval == 300.0
    old = decode(_format_1(data), NAMESPACE, "e1")
    assert old.interval is None and list(old.keys) == [k(0), k(1)] and old.session == 7


def test_a_writer_is_live_for_three_of_its_own_intervals() -> None:
    """`is_live` and `clash` judge a writer by the interval its manifest says, not the
    reader's: one that writes every 5 minutes, last 10 minutes ago, is alive; one that writes
    every 10 s, last a minute ago, is not; unknown or 0: the reader's default."""
    now = time.time()

    def at(ago: float, interval: float | None) -> Manifest:
        return Manifest(
            NAMESPACE,
            "e1",
            [],
            host="elsewhere",
            session=9,
            written_at=now - ago,
            interval=interval,
        )

    assert is_live(at(600, 300.0), now, 180.0)
    assert not is_live(at(60, 10.0), now, 180.0)
    assert is_live(at(100, None), now, 180.0) and not is_live(at(200, None), now, 180.0)
    assert not is_live(at(200, 0.0), now, 180.0)
    assert clash(at(500, 600.0), interval=60.0, session=1, now=now) is not None
    assert clash(at(500, 60.0), interval=600.0, session=1, now=now) is None


def test_a_manifest_of_another_namespace_or_engine_is_refused() -> None:
    with pytest.raises(ManifestRefused, match="namespace"):
        decode(encode(manifest(namespace=bytes(16))), NAMESPACE, "e1")
    with pytest.raises(ManifestRefused, match="engine"):
        decode(encode(manifest("e2")), NAMESPACE, "e1")


def test_the_default_identity_is_stable_per_host_and_namespace() -> None:
    one = engine_identity(None, NAMESPACE, host="a")
    assert one == engine_identity(None, NAMESPACE, host="a")
    assert one != engine_identity(None, NAMESPACE, host="b")
    assert one != engine_identity(None, bytes(16), host="a")
    assert engine_identity("gpu-0", NAMESPACE) == "gpu-0"


def test_hottest_is_lru_order_and_arcs_frequency_list_before_its_recency_list() -> None:
    lru: LRUPolicy[int, int] = LRUPolicy(8)
    for i in range(4):
        lru.insert(i, i)
    lru.touch([1])
    assert lru.hottest(10) == [1, 3, 2, 0]
    arc: ARCPolicy[int, int] = ARCPolicy(8)
    for i in range(4):
        arc.insert(i, i)
    arc.touch([2, 0])  # T2: 2, 0; T1: 1, 3
    assert arc.hottest(10) == [0, 2, 3, 1]
    assert arc.hottest(3) == [0, 2, 3]


def test_a_sealed_manifest_is_refused_by_tiers_of_its_namespace_without_the_seal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A manifest planted unsealed in a secret's names is refused (auth) with one line; under
    another secret's names it is not even found."""
    mine = store_namespace(NAMESPACE, SECRET)

    async def run() -> None:
        async with file_tier(tmp_path, namespace=mine) as forger:  # no secret, my names
            await forger.write_record(record_name("e1"), encode(manifest(namespace=mine)))
        async with file_tier(tmp_path, secret=SECRET, namespace=mine) as reader:
            with caplog.at_level(logging.WARNING, "tiering.manager.manifest"):
                found, why = await read_manifest([reader], mine, "e1")
            assert found is None and "auth" in why
            said = [r for r in caplog.records if r.name == "tiering.manager.manifest"]
            assert len(said) == 1
            with pytest.raises(CorruptObject):
                await reader.read_record(record_name("e1"))
        other = store_namespace(NAMESPACE, b"o" * 32)
        async with file_tier(tmp_path, secret=b"o" * 32, namespace=other) as stranger:
            assert await stranger.read_record(record_name("e1")) is None

    asyncio.run(run())


# -- through the manager ------------------------------------------------------------------------


def resident(h: Harness) -> set[int]:
    with h.manager.quiet():
        pool = h.manager.pool
        return {i for i in range(64) if k(i) in pool and pool.state(k(i)) is KeyState.READY}


def warm_ended(h: Harness) -> Callable[[], bool]:
    warm = h.manager.warm
    return lambda: warm.budget == 0 and not warm.warming


def first_engine(
    make: Callable[..., Harness], path: Path, layout: str, hot: list[int], **primary: Any
) -> Harness:
    """An engine that stored blocks 0-9 in order (9 the newest written) through a file tier,
    then used `hot` (the last the hottest), and stopped: its manifest is written at shutdown."""
    h = make([(THROUGH, file_tier(path, layout))], slots=16, primary=warm(2, **primary))
    for i in range(10):
        h.store(i)
        h.settle()
        time.sleep(0.01)  # the files layout orders by mtime, which the kernel sets per tick
    h.manager.touch([k(i) for i in hot])
    h.close()
    return h


@pytest.fixture(params=["files", "segments"])
def layout(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_a_restart_reads_what_the_last_engine_used_not_what_it_wrote_last(
    make: Callable[..., Harness], tmp_path: Path, layout: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Blocks 0 and 1 were written first (the oldest by write time) and used last: a budget of
    two reads them, not 8 and 9 (the newest written, what today's plan read)."""
    first_engine(make, tmp_path, layout, hot=[1, 0])
    with caplog.at_level(logging.INFO, "tiering.manager.warm"):
        h = make([(THROUGH, file_tier(tmp_path, layout))], slots=16, primary=warm(2))
        wait_for(h, warm_ended(h))
    assert resident(h) == {0, 1}
    assert h.manager.warm.source == "manifest"
    snapshot = h.manager.snapshot()["manager"]
    assert snapshot[WARM_PLANNED] == 2 and snapshot[BLOCKS_WARMED] == 2
    assert snapshot["warm_source"] == 1 and snapshot["warm_remaining"] == 0
    lines = [r.getMessage() for r in caplog.records]
    assert any("following the last run's manifest of use" in line for line in lines)
    assert any("2 planned, 2 read, 0 skipped" in line for line in lines)


def test_a_bad_manifest_is_refused_with_one_line_and_the_newest_plan_runs(
    make: Callable[..., Harness], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The record file damaged on disk: refused (one warning), nothing raised, nothing read
    from it; the tiers' newest are read instead, and the log says why."""
    first_engine(make, tmp_path, "files", hot=[1, 0])
    (record,) = (tmp_path / ".kvtier" / "records").iterdir()
    data = bytearray(record.read_bytes())
    data[-5] ^= 0xFF
    record.write_bytes(bytes(data))
    with caplog.at_level(logging.INFO):
        h = make([(THROUGH, file_tier(tmp_path))], slots=16, primary=warm(2))
        wait_for(h, warm_ended(h))
    assert resident(h) == {8, 9}
    assert h.manager.warm.source == "newest"
    refused = [
        r for r in caplog.records if "manifest of" in r.getMessage() and "refused" in r.getMessage()
    ]
    assert len(refused) == 1
    assert any("the tiers' newest (no usable manifest" in r.getMessage() for r in caplog.records)


@pytest.mark.redis
def test_a_manifest_whose_blocks_every_tier_lost_is_skipped_and_counted(
    make: Callable[..., Harness], tmp_path: Path, redis_server: Any
) -> None:
    """The manifest names blocks that neither the file tier (indexed: known absent at once)
    nor Redis (asked with the batch) holds any more: all skipped and counted, none read."""
    from tiers.redis import RedisTier

    def redis() -> Tier:
        return RedisTier(namespace=NAMESPACE, name="redis", url=redis_server.url)

    both = [THROUGH, TierConfig(name="redis", type="redis", write="through")]
    h = make([(both[0], file_tier(tmp_path)), (both[1], redis())], slots=16, primary=warm(8))
    for i in range(40, 46):
        h.store(i)
        h.settle()
    h.close()
    for _, tier in h.tiers:  # every tier evicts them: a fresh tier over each store deletes

        async def drop(tier: Tier = tier) -> None:
            fresh = file_tier(tmp_path) if tier.name == "nvme" else redis()
            async with fresh:
                for i in range(40, 46):
                    await fresh.delete(k(i))

        asyncio.run(drop())
    file_tier_again, redis_again = file_tier(tmp_path), redis()
    h2 = make([(both[0], file_tier_again), (both[1], redis_again)], slots=16, primary=warm(8))
    wait_for(h2, warm_ended(h2))
    snapshot = h2.manager.snapshot()
    manager = snapshot["manager"]
    assert h2.manager.warm.source == "manifest"
    assert manager[BLOCKS_WARMED] == 0
    assert manager[WARM_SKIPPED] == 6
    assert manager["warm_remaining"] == 0
    assert resident(h2) == set()
    assert file_tier_again.counters["hits"] == 0 and redis_again.counters["hits"] == 0


def test_two_live_engines_of_one_identity_on_one_store_are_told_so(
    make: Callable[..., Harness], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A second engine with the first's `engine_id` on the same directory finds the first's
    fresh manifest at its first write and says so (counted); an engine of another identity,
    and the same identity after the first's shutdown, are not told anything."""
    primary = warm(2, engine_id="gpu-0", warm_manifest_interval=0.05)
    one = make([(THROUGH, file_tier(tmp_path))], slots=16, primary=primary)
    recorder = one.manager.recorder
    assert recorder is not None
    wait_for(one, lambda: recorder.written >= 1)
    other = make(
        [(THROUGH, file_tier(tmp_path))],
        slots=16,
        primary=warm(2, engine_id="gpu-1", warm_manifest_interval=0.05),
    )
    with caplog.at_level(logging.WARNING, "tiering.manager.recorder"):
        two = make([(THROUGH, file_tier(tmp_path))], slots=16, primary=primary)
        wait_for(two, lambda: two.manager.counters[MANIFEST_CLASHES] == 1)
    assert any("engine identity gpu-0" in r.getMessage() for r in caplog.records)
    other_recorder = other.manager.recorder
    assert other_recorder is not None
    wait_for(other, lambda: other_recorder.written >= 2)
    assert other.manager.counters[MANIFEST_CLASHES] == 0
    one.close()
    two.close()
    again = make([(THROUGH, file_tier(tmp_path))], slots=16, primary=primary)
    again_recorder = again.manager.recorder
    assert again_recorder is not None
    wait_for(again, lambda: again_recorder.written >= 2)
    assert again.manager.counters[MANIFEST_CLASHES] == 0


class SlowRecords(ForwardingTier):
    """A files directory whose record writes take `SLOW_WRITE` seconds (a slow store)."""

    async def _write_record(self, name: str, blob: bytes) -> bool:
        await asyncio.sleep(SLOW_WRITE)
        return await super()._write_record(name, blob)


SLOW_WRITE = 0.03


def test_manifest_writes_take_at_most_one_percent_of_the_time_however_short_the_interval(
    make: Callable[..., Harness], tmp_path: Path
) -> None:
    """An interval of 10 ms to a store whose writes take 30 ms: after the first write the next
    waits 100 times its time (3 s and more), not the interval: a second sees no other."""
    tier = SlowRecords(file_tier(tmp_path))
    h = make([(THROUGH, tier)], slots=16, primary=warm(2, warm_manifest_interval=0.01))
    recorder = h.manager.recorder
    assert recorder is not None
    wait_for(h, lambda: recorder.written >= 1)
    time.sleep(1.0)
    assert recorder.written == 1
    assert recorder.pause >= 100 * SLOW_WRITE


def test_kvtier_manifest_shows_the_order_and_the_last_warm_start(
    make: Callable[..., Harness], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The manifest an engine left, read-only: its keys hottest first and its warm start, also
    in `kvtier stats`."""
    import json

    from kvtier.cli import main

    store = tmp_path / "store"
    first_engine(make, store, "files", hot=[1, 0], engine_id="gpu-0")
    config = tmp_path / "kvtier.yaml"
    config.write_text(
        f"primary: {{engine_id: gpu-0}}\ntiers: [{{name: nvme, type: file, path: {store}, "
        "min_free: 0}]\n"
    )
    code = main(["manifest", "--config", str(config), "--tier", "nvme", "--keys", "2", "--json"])
    shown = json.loads(capsys.readouterr().out)
    assert code == 0
    assert shown["hottest"] == [k(0).hex(), k(1).hex()]
    assert shown["engine"] == "gpu-0" and shown["ended"] and shown["blocks"] == 10
    assert shown["warm_source"] == "newest"
    assert main(["manifest", "--config", str(config), "--tier", "nvme", "--engine", "x"]) == 1
    code = main(["stats", "--config", str(config), "--json"])
    (row,) = json.loads(capsys.readouterr().out)
    assert code == 0
    assert row["warm"]["engine"] == "gpu-0" and row["warm"]["blocks"] == 10
    assert row["warm"]["warm_source"] == "newest" and row["warm"]["warm_remaining"] == 0
    assert main(["stats", "--config", str(config)]) == 0
    assert "manifest of 10 blocks" in capsys.readouterr().out
