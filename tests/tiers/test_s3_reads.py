"""Engines' records of what they read from an S3 prefix, and the sweeper keeping the least
recently used (real SeaweedFS; the format's own checks without a server): a block the fleet
read lately outlives newer blocks nobody read, as a `files` directory's mtime and Redis's LRU
give; a record that is crafted, unsealed, dated ahead or too large reorders at most; a writer
that cannot write its record loses nothing on the data path; records of writers gone a day
are removed."""

from __future__ import annotations

import asyncio
import json
import math
import struct
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import tiers.s3.reads
import tiers.s3.use
from kvtier.cli import main
from kvtier.servers import SeaweedS3
from tests.tiers.s3_tiers import (
    SECRET,
    fill_ten,
    present_of_ten,
    s3_tier,
    s3_tier_entry,
    sweep_to_capacity,
    use_prefix,
)
from tiering.errors import TierUnavailable
from tiering.testing import NAMESPACE, key, payload
from tiers.s3.reads import MAX_READS, ReadLog, Reads, ReadsRefused, decode, encode, reads_name

BLOCK = 4000


async def _read(server: SeaweedS3, prefix: str, blocks: list[int], **options: Any) -> None:
    """An engine's tier (with a capacity, so it records reads) gets `blocks` and closes,
    which writes its record of reads."""
    async with s3_tier(server, prefix, capacity=1 << 30, **options) as engine:
        out = bytearray(BLOCK)
        for i in blocks:
            assert await engine.get(key(i), out)
        assert engine._reads is not None and engine._reads._changed
    assert engine.counters["reads_records_written"] == 1


# -- the format, no server ----------------------------------------------------------------------


def _record(count: int = 3, **fields: Any) -> Reads:
    values: dict[str, Any] = {
        "namespace": NAMESPACE,
        "written_at": 1000.0,
        "interval": 30.0,
        "keys": [key(i) for i in range(count)],
        "ages": [float(i) for i in range(count)],
        **fields,
    }
    return Reads(**values)


def test_a_record_reads_back_as_written() -> None:
    record = _record()
    assert decode(encode(record), NAMESPACE) == record


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (lambda b: b[:-1], "truncated"),
        (lambda b: b + b"\x00", "corrupt"),
        (lambda b: b"KVTWARM\x00" + b[8:], "magic"),
        (lambda b: b[:10] + bytes(16) + b[26:], "namespace"),
        (lambda b: b[:-4] + struct.pack(">f", math.nan), "corrupt"),
        (lambda b: b[:-4] + struct.pack(">f", -1.0), "corrupt"),
        (lambda b: b[:26] + struct.pack(">d", math.inf) + b[34:], "corrupt"),
        (lambda b: b[:42] + (MAX_READS + 1).to_bytes(4, "big") + b[46:], "size"),
    ],
)
def test_a_damaged_or_crafted_record_is_refused_whole(body: Any, reason: str) -> None:
    with pytest.raises(ReadsRefused, match=f"^{reason}"):
        decode(body(encode(_record())), NAMESPACE)


def test_the_log_keeps_the_newest_reads_of_its_window_and_at_most_max_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Noted at times 0..9 with an interval of 1 s at time 9: the last three seconds' reads,
    newest first; past `MAX_READS` the oldest is forgotten; a key read again moves up."""
    monkeypatch.setattr(tiers.s3.reads, "MAX_READS", 8)
    now = [0.0]
    log = ReadLog(
        tier="t",
        namespace=NAMESPACE,
        name=reads_name(b"w"),
        interval=1.0,
        write=lambda name, body: asyncio.sleep(0),
        counters=Counter(),
        clock=lambda: now[0],
    )
    log._task.ensure = lambda: True  # type: ignore[method-assign]
    for i in range(10):
        now[0] = float(i)
        log.note(key(i))
    assert len(log._read) == 8 and key(0) not in log._read and key(1) not in log._read
    now[0] = 9.5
    log.note(key(5))
    record = log.record()
    assert record.keys == [key(5), key(9), key(8), key(7)]
    assert record.ages == [0.0, 0.5, 1.5, 2.5]


# -- on a real server ---------------------------------------------------------------------------


def test_blocks_the_fleet_read_lately_outlive_newer_blocks_nobody_read(
    s3_server: SeaweedS3,
) -> None:
    """Blocks 0-4 written first, 5-9 a second later; another engine then reads 0-2. Room for
    three and a half objects: 0, 1 and 2 stay (read last), where write order keeps 7-9, and
    the pass counts as by use."""
    prefix = use_prefix()

    async def body() -> None:
        size = await fill_ten(s3_server, prefix)
        await asyncio.sleep(1.1)
        await _read(s3_server, prefix, [0, 1, 2])
        async with s3_tier(s3_server, prefix, capacity=size * 7 // 2) as tier:
            await sweep_to_capacity(tier)
            assert await present_of_ten(tier) == [0, 1, 2]
            assert tier.counters["sweeps_by_use"] == 1
            order = await tier.sweep_order()
            assert order is not None and order.readers == 1 and len(order.reads) == 3
            assert order.interval == 30.0  # the reader's interval: the ranks are kept 30 s
            assert order.line() == (
                "by use: 0 live manifests, 0 keys named; 1 records of reads, 3 keys read"
            )

    asyncio.run(body())


def test_with_reads_interval_zero_nothing_is_recorded_and_the_sweeper_goes_by_write_order(
    s3_server: SeaweedS3,
) -> None:
    prefix = use_prefix()

    async def body() -> None:
        size = await fill_ten(s3_server, prefix)
        async with s3_tier(s3_server, prefix, capacity=1 << 30, reads_interval=0) as engine:
            out = bytearray(BLOCK)
            for i in range(3):
                assert await engine.get(key(i), out)
        assert not engine.counters["reads_records_written"]
        async with s3_tier(s3_server, prefix, capacity=size * 7 // 2) as tier:
            await sweep_to_capacity(tier)
            assert await present_of_ten(tier) == [7, 8, 9]
            assert tier.counters["sweeps_write_order"] == 1

    asyncio.run(body())


def test_a_write_that_finds_the_block_there_counts_as_a_use(s3_server: SeaweedS3) -> None:
    """With `write_once`, an engine putting blocks 0-2 again writes nothing, but the fleet
    wanted them: they are recorded and kept before the newer 5-9. (The engine's puts start its
    sweeper, which may leave the lease to lapse: the sweeping tier waits for it, bounded.)"""
    prefix = use_prefix()

    async def body() -> None:
        size = await fill_ten(s3_server, prefix)
        await asyncio.sleep(1.1)
        async with s3_tier(s3_server, prefix, capacity=1 << 30) as engine:
            for i in range(3):
                await engine.put(key(i), payload(BLOCK, i))
        async with s3_tier(s3_server, prefix, capacity=size * 7 // 2) as tier:
            assert tier._sweeper is not None
            deadline = time.monotonic() + 30
            while not await tier._sweeper.lease.keep():
                assert time.monotonic() < deadline, "the lease never lapsed"
                await asyncio.sleep(0.5)
            await sweep_to_capacity(tier)
            assert await present_of_ten(tier) == [0, 1, 2]

    asyncio.run(body())


def test_crafted_records_reorder_at_most_and_are_refused_unsealed_or_too_large(
    s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a secret, a stranger's unsealed record naming 5-9 is refused (counted); a sealed
    one dated a day ahead counts as read now, not later than the next real read; one larger
    than the reader takes is refused. The prefix is still swept to capacity."""
    monkeypatch.setattr(tiers.s3.use, "MAX_READS_BYTES", 4096)
    prefix = use_prefix()

    async def body() -> None:
        size = await fill_ten(s3_server, prefix, secret=SECRET)
        async with s3_tier(s3_server, prefix) as stranger:
            unsealed = _record(5, written_at=time.time(), keys=[key(i) for i in range(5, 10)])
            await stranger.write_record(reads_name(b"stranger"), encode(unsealed))
        async with s3_tier(s3_server, prefix, secret=SECRET) as sealed:
            ahead = _record(1, written_at=time.time() + 86_400, keys=[key(3)], ages=[0.0])
            await sealed.write_record(reads_name(b"ahead"), encode(ahead))
            huge = _record(200, written_at=time.time(), keys=[key(i, 1) for i in range(200)])
            await sealed.write_record(reads_name(b"huge"), encode(huge))
        await asyncio.sleep(1.1)
        await _read(s3_server, prefix, [0], secret=SECRET)
        async with s3_tier(s3_server, prefix, secret=SECRET, capacity=size * 5 // 2) as tier:
            await sweep_to_capacity(tier)
            assert await present_of_ten(tier) == [0, 3]
            order = await tier._use.read()
            assert order.readers == 2 and order.refused_reads == 2
            assert tier.counters["use_reads_refused"] >= 2
            assert max(order.reads.values()) <= time.time() + 5

    asyncio.run(body())


def test_a_record_that_cannot_be_written_costs_the_data_path_nothing(
    s3_server: SeaweedS3,
) -> None:
    """The server refusing every record write: reads go on and hit, the failure is counted
    and the close ends."""
    prefix = use_prefix()

    async def body() -> None:
        await fill_ten(s3_server, prefix)
        engine = s3_tier(s3_server, prefix, capacity=1 << 30, reads_interval=0.05)

        async def down(name: str, blob: bytes) -> bool:
            raise TierUnavailable("the server is down")

        engine._write_record = down  # type: ignore[method-assign]
        out = bytearray(BLOCK)
        for _ in range(3):
            for i in range(3):
                assert await engine.get(key(i), out)
            await asyncio.sleep(0.15)
        await asyncio.wait_for(engine.close(), 10)
        assert engine.counters["reads_record_failures"] >= 2
        assert not engine.counters["reads_records_written"]

    asyncio.run(body())


def test_records_of_writers_gone_a_day_are_removed_by_the_sweeper(
    s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record last written longer than `READS_EXPIRE` ago is removed by the lease holder's
    reading; a fresh one stays."""
    prefix = use_prefix()

    async def body() -> None:
        size = await fill_ten(s3_server, prefix)
        await _read(s3_server, prefix, [0])
        await asyncio.sleep(5.1)
        await _read(s3_server, prefix, [1])
        monkeypatch.setattr(tiers.s3.use, "READS_EXPIRE", 4.0)  # LastModified: whole seconds
        async with s3_tier(s3_server, prefix, capacity=size * 7 // 2) as tier:
            await sweep_to_capacity(tier)
            names = await tier.list_records("reads.")
            assert len(names) == 1 and tier.counters["reads_records_expired"] == 1

    asyncio.run(body())


def test_stats_says_the_sweeper_follows_the_records_of_reads(
    s3_server: SeaweedS3, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = use_prefix()

    async def body() -> int:
        size = await fill_ten(s3_server, prefix)
        await _read(s3_server, prefix, [0, 1])
        return size

    size = asyncio.run(body())
    tier = s3_tier_entry(s3_server, prefix, capacity=size * 11 // 2)
    config = tmp_path / "kvtier.yaml"
    config.write_text(json.dumps({"tiers": [tier]}))
    assert main(["stats", "--config", str(config), "--json"]) == 0
    order = json.loads(capsys.readouterr().out)[0]["sweep_order"]
    assert order["order"] == "use" and order["read_records"] == 1 and order["read_keys"] == 2


def test_a_record_unchanged_since_the_last_reading_is_not_read_again(
    s3_server: SeaweedS3,
) -> None:
    """Many engines' records are read every few seconds: one whose LastModified and size are
    as at the last reading is not fetched again, yet still counts; a new one is read."""
    prefix = use_prefix()

    async def body() -> None:
        size = await fill_ten(s3_server, prefix)
        await _read(s3_server, prefix, [0, 1])
        async with s3_tier(s3_server, prefix, capacity=size * 7 // 2) as tier:
            fetched: list[str] = []
            get = tier._bucket.get

            async def spy(name: str, limit: int) -> Any:
                fetched.append(name)
                return await get(name, limit)

            tier._bucket.get = spy  # type: ignore[method-assign]
            first = await tier._use.read()
            again = await tier._use.read()
            assert first.readers == again.readers == 1 and len(again.reads) == 2
            assert sum(".reads." in name for name in fetched) == 1
            await asyncio.sleep(1.1)  # LastModified has whole seconds
            await _read(s3_server, prefix, [2])  # another writer: a second record
            third = await tier._use.read()
            assert third.readers == 2 and len(third.reads) == 3
            assert sum(".reads." in name for name in fetched) == 2

    asyncio.run(body())


def test_a_pack_lives_as_long_as_its_most_recently_read_block(s3_server: SeaweedS3) -> None:
    """Packs of five blocks: 0-4 in the older pack, 5-9 in the newer. An engine reads block 0;
    with room for one and a half packs the sweeper removes the newer pack whole and keeps the
    one whose block was read last (write order removes the older)."""
    prefix = use_prefix()
    packed = {"blocks_per_object": 5, "pack_after": 0.05}

    async def body() -> None:
        size = await fill_ten(s3_server, prefix, **packed)
        await asyncio.sleep(1.1)
        await _read(s3_server, prefix, [0], **packed)
        async with s3_tier(s3_server, prefix, capacity=size * 3 // 2, **packed) as tier:
            await tier.contains([key(0)])  # the index of packs loads: it says what each holds
            await sweep_to_capacity(tier)
            assert await present_of_ten(tier) == [0, 1, 2, 3, 4]
            assert tier.counters["sweeps_by_use"] == 1

    asyncio.run(body())
