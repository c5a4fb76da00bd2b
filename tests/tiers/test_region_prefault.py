"""The region's prefault under many slots and several workers: the caller's time, chunk sizes, exact
coverage of each shard."""

from __future__ import annotations

import time

from tiers.region import PAGE, RegionLayout
from tiers.region.prefault import PREFAULT_CHUNK, shard_pages


def test_shard_ranges_are_at_most_one_chunk() -> None:
    """The docstring (and close's 'within one chunk') say chunks of at most PREFAULT_CHUNK:
    a merged run grows past it, and one shard larger than a chunk is never split."""
    layout = RegionLayout(num_slots=64, shard_bytes=3 * (1 << 20) + 1000, num_workers=1)
    ranges = list(shard_pages(1 << 30, layout, 0))
    assert max(length for _, length in ranges) <= PREFAULT_CHUNK
    big = RegionLayout(num_slots=2, shard_bytes=40 << 20, num_workers=1)
    assert max(length for _, length in shard_pages(1 << 30, big, 0)) <= PREFAULT_CHUNK


def test_shard_ranges_cover_each_shard_exactly_once() -> None:
    """(sound: passes) every byte of the rank's shards is covered, ranges are page aligned and
    do not overlap."""
    for workers, shard in ((1, 5000), (2, 5000), (3, 4096), (2, 20 << 20)):
        layout = RegionLayout(num_slots=37, shard_bytes=shard, num_workers=workers)
        for rank in range(workers):
            ranges = list(shard_pages(0, layout, rank))
            assert all(a % PAGE == 0 for a, _ in ranges)
            ends = [(a, a + n) for a, n in ranges]
            assert all(e0 <= a1 for (_, e0), (a1, _) in zip(ends, ends[1:], strict=False))
            for slot in range(layout.num_slots):
                lo = slot * layout.slot_stride + rank * shard
                hi = lo + shard
                assert sum(max(0, min(e, hi) - max(a, lo)) for a, e in ends) == shard


def test_prefault_does_not_spend_the_callers_time_on_many_slots() -> None:
    """`prefault(rank)` lists every slot's range on the caller's thread (the worker's start)
    before the background thread starts: ~1 s per million slots here (a 4 GiB primary of 4 KiB
    shards in /dev/shm; only the first chunk is mapped before close stops the thread)."""
    import tempfile

    from tiers.region import PrimaryRegion

    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        layout = RegionLayout(num_slots=1 << 20, shard_bytes=PAGE, num_workers=1)
        with PrimaryRegion.create("many", layout, directory) as region:
            began = time.perf_counter()
            assert region.prefault(rank=0)
            spent = time.perf_counter() - began
            region.close()
    assert spent < 0.2, f"prefault(rank=0) took {spent:.2f}s on the caller's thread"
