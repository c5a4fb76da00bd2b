"""The S3 sweeper removes by use as far as engines tell it (real SeaweedFS): the objects no
live engine's manifest of use names go first, then the named ones least hot first; with no
live manifest, write order, and `kvtier stats` says which. A crafted manifest reorders at
most: it never stops the sweep, never reaches past the prefix, and is refused unsealed under
a secret or too large."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

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
from tiering.keys import BlockKey
from tiering.manager.manifest import Manifest, encode, record_name
from tiering.testing import NAMESPACE, key
from tiers.s3 import S3Tier

pytestmark = pytest.mark.s3


async def _manifest(tier: S3Tier, engine: str, keys: Sequence[BlockKey], **fields: Any) -> None:
    await tier.write_record(
        record_name(engine), encode(Manifest(NAMESPACE, engine, list(keys), **fields))
    )


def test_the_objects_no_live_manifest_names_go_first_then_the_least_hot(
    s3_server: SeaweedS3,
) -> None:
    """The oldest-written blocks 0-4 are named by a live engine's manifest (0 hottest), the
    newer 5-9 by none; room for three and a half objects: 5-9 go, then the least hot named
    (4, 3); 0-2 stay. Write order would have removed 0-6."""
    prefix = use_prefix()

    async def body() -> None:
        size = await fill_ten(s3_server, prefix)
        async with s3_tier(s3_server, prefix, capacity=size * 7 // 2) as tier:
            await _manifest(tier, "gpu-0", [key(i) for i in range(5)])
            await sweep_to_capacity(tier)
            assert await present_of_ten(tier) == [0, 1, 2]
            assert tier.counters["sweeps_by_use"] == 1 and not tier.counters["sweeps_write_order"]
            order = await tier.sweep_order()
            assert order is not None and order.line() == "by use: 1 live manifests, 5 keys named"

    asyncio.run(body())


@pytest.mark.parametrize(
    ("ago", "interval", "kept"), [(400, 300.0, [0, 1, 2]), (60, 10.0, [7, 8, 9])]
)
def test_a_manifest_is_live_for_three_of_its_writers_own_intervals(
    s3_server: SeaweedS3, ago: float, interval: float, kept: list[int]
) -> None:
    """An engine writing its manifest every 5 minutes, last 400 s ago, is alive: its blocks
    0-4 are kept before the newer unnamed ones. One writing every 10 s, last a minute ago, is
    not: write order (with the sweeper's old fixed 180 s, the first went by write order and
    the second by use)."""
    prefix = use_prefix()

    async def body() -> None:
        size = await fill_ten(s3_server, prefix)
        async with s3_tier(s3_server, prefix, capacity=size * 7 // 2) as tier:
            fields = {"written_at": time.time() - ago, "interval": interval}
            await _manifest(tier, "gpu-0", [key(i) for i in range(5)], **fields)
            await sweep_to_capacity(tier)
            assert await present_of_ten(tier) == kept

    asyncio.run(body())


def test_the_sweeper_follows_a_manifest_written_every_two_seconds_within_seconds(
    s3_server: SeaweedS3,
) -> None:
    """An engine writing its manifest every 2 s names blocks 5-9, then, once the sweeper has
    read that, 0-4 instead; 2.5 s later the next sweep keeps 0-2 (the newest manifest) and
    removes the newer 5-9. With the ranks kept a fixed minute it followed the first manifest
    and kept 5-7."""
    prefix = use_prefix()

    async def body() -> None:
        size = await fill_ten(s3_server, prefix)
        async with s3_tier(s3_server, prefix, capacity=size * 7 // 2) as tier:
            await _manifest(tier, "gpu-0", [key(i) for i in range(5, 10)], interval=2.0)
            first = await tier.sweep_order()
            assert first is not None and first.interval == 2.0
            await _manifest(tier, "gpu-0", [key(i) for i in range(5)], interval=2.0)
            await asyncio.sleep(2.5)
            await sweep_to_capacity(tier)
            assert await present_of_ten(tier) == [0, 1, 2]

    asyncio.run(body())


@pytest.mark.parametrize("stale", ["ended", "old"])
def test_with_no_live_manifest_it_sweeps_in_write_order_and_stats_says_so(
    s3_server: SeaweedS3, tmp_path: Path, capsys: pytest.CaptureFixture[str], stale: str
) -> None:
    """A manifest written at its engine's shutdown, or ten minutes ago, is no live engine's:
    the oldest written (0-4) go although it names them, counted as a write-order sweep, and
    `kvtier stats` (text and JSON) says write order; a live one then makes it say by use."""
    prefix = use_prefix()
    fields = {"ended": True} if stale == "ended" else {"written_at": time.time() - 600}

    async def body() -> int:
        size = await fill_ten(s3_server, prefix)
        async with s3_tier(s3_server, prefix, capacity=size * 11 // 2) as tier:
            await _manifest(tier, "gpu-0", [key(i) for i in range(5)], **fields)
            await sweep_to_capacity(tier)
            assert await present_of_ten(tier) == [5, 6, 7, 8, 9]
            assert tier.counters["sweeps_write_order"] == 1 and not tier.counters["sweeps_by_use"]
        return size

    size = asyncio.run(body())
    config = tmp_path / "kvtier.yaml"
    tier = s3_tier_entry(s3_server, prefix, capacity=size * 11 // 2)
    config.write_text(json.dumps({"tiers": [tier]}))
    assert main(["stats", "--config", str(config), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    order = rows[0]["sweep_order"]
    assert order["order"] == "write" and order["live_manifests"] == 0
    assert order["stale_manifests"] == 1
    assert main(["stats", "--config", str(config)]) == 0
    text = capsys.readouterr().out
    assert "tier objects, its sweeper's order: write order: no live manifest" in text

    async def live() -> None:
        async with s3_tier(s3_server, prefix) as tier:
            await _manifest(tier, "gpu-1", [key(i) for i in range(5, 8)])

    asyncio.run(live())
    assert main(["stats", "--config", str(config)]) == 0
    assert "its sweeper's order: by use: 1 live manifests, 3 keys named" in capsys.readouterr().out


def test_under_a_secret_an_unsealed_manifest_is_ignored_and_counted(
    s3_server: SeaweedS3,
) -> None:
    """Under `auth.secret`, a manifest written without it in the tier's names (a stranger's)
    is refused (counted) and not followed: write order."""
    prefix = use_prefix()

    async def body() -> None:
        size = await fill_ten(s3_server, prefix, secret=SECRET)
        async with s3_tier(s3_server, prefix) as stranger:
            await _manifest(stranger, "gpu-0", [key(i) for i in range(5)])
        async with s3_tier(s3_server, prefix, secret=SECRET, capacity=size * 11 // 2) as tier:
            await sweep_to_capacity(tier)
            assert await present_of_ten(tier) == [5, 6, 7, 8, 9]
            assert tier.counters["use_manifests_refused"] >= 1
            assert tier.counters["sweeps_write_order"] == 1
            await _manifest(tier, "gpu-1", [key(i) for i in range(5, 10)])  # sealed: followed
            order = await tier._use.read()
            assert order.live == 1 and order.refused == 1 and len(order.ranks) == 5

    asyncio.run(body())


def test_a_manifest_naming_everything_reorders_but_never_stops_the_sweep_or_crosses_theuse_prefix(
    s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stranger's manifest naming every block (and keys of a neighbouring prefix) plus one too
    large to read: the prefix is still swept to capacity, nothing outside it is removed, the
    named keys are capped at `MAX_NAMED` shared among the manifests listed (clipped, counted),
    and the too-large one is refused."""
    import tiers.s3.use

    monkeypatch.setattr(tiers.s3.use, "MAX_MANIFEST_BYTES", 64 << 10)
    monkeypatch.setattr(tiers.s3.use, "MAX_NAMED", 8)
    prefix, neighbour = use_prefix(), use_prefix()

    async def body() -> None:
        size = await fill_ten(s3_server, prefix)
        await fill_ten(s3_server, neighbour)
        async with s3_tier(s3_server, prefix, capacity=size * 5 // 2) as tier:
            await _manifest(tier, "stranger", [key(i) for i in range(10)])
            await _manifest(tier, "huge", [key(i, 1) for i in range(3000)])  # ~111 KB
            await sweep_to_capacity(tier)
            kept = await present_of_ten(tier)
            assert kept == [0, 1], kept
            listed = await tier._bucket.list_objects_meta(prefix + NAMESPACE.hex())
            assert sum(size for _, size, _ in listed) <= size * 5 // 2
            order = await tier._use.read()
            assert order.live == 1 and order.refused == 1
            assert len(order.ranks) == 4 and order.clipped == 6
            assert tier.counters["use_keys_clipped"] >= 6
        async with s3_tier(s3_server, neighbour) as other:
            assert await present_of_ten(other) == list(range(10))

    asyncio.run(body())
