"""The region's prefault under many slots and several workers: the caller's time, chunk sizes, exact
coverage of each shard; its two parts: the first slots before it returns, the rest in the
background, waiting while the process's other threads compute."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from tiers.region import PAGE, RegionLayout
from tiers.region.prefault import PREFAULT_CHUNK, Pacer, shard_pages, slot_ranges


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


class FakeClock:
    """The process's CPU time advances by one second per look while `busy` is set (the engine's
    threads computing); wall time by one second per look; the prefault thread's own by none."""

    def __init__(self) -> None:
        self.busy = threading.Event()
        self.process = self.wall = 0.0

    def __call__(self) -> tuple[float, float, float]:
        self.wall += 1.0
        if self.busy.is_set():
            self.process += 1.0
        return self.process, 0.0, self.wall


def test_the_pacer_waits_while_other_threads_compute() -> None:
    clock = FakeClock()
    pacer = Pacer(clock, pause=0.001)
    assert not pacer.busy()  # an idle engine
    clock.busy.set()
    assert pacer.busy()
    stop = threading.Event()
    waiter = threading.Thread(target=pacer.wait, args=(stop,))
    waiter.start()
    time.sleep(0.05)
    assert waiter.is_alive()  # held while the engine computes
    clock.busy.clear()
    waiter.join(5)
    assert not waiter.is_alive() and pacer.paused > 0


def test_a_real_busy_thread_counts_and_the_pacers_own_time_does_not() -> None:
    """(sound: a thread spinning in this process makes it busy; the pacer's thread spinning
    itself does not)"""
    pacer = Pacer()
    deadline = time.monotonic() + 0.05
    while time.monotonic() < deadline:  # the pacer's own thread computes
        pass
    assert not pacer.busy()
    pacer = Pacer(share=0.02)  # a spinner on a loaded machine still gets more than 2 % of a core
    done = threading.Event()
    spinner = threading.Thread(target=lambda: [None for _ in iter(done.is_set, True)])
    spinner.start()
    try:
        time.sleep(0.2)  # the spinner holds the GIL most of the time: CPU of another thread
        assert pacer.busy()
    finally:
        done.set()
        spinner.join()


def test_the_first_slots_are_mapped_before_prefault_returns_and_the_rest_waits_for_idle(
    tmp_path: Path,
) -> None:
    """`sync` bytes (rounded up to slots) are mapped on the caller's thread; the background
    part maps nothing while the process's other threads compute, and all once they stop."""
    from tiers.region import PrimaryRegion
    from tiers.region import prefault as module

    clock = FakeClock()
    clock.busy.set()
    layout = RegionLayout(num_slots=32, shard_bytes=1 << 20)
    with PrimaryRegion.create("paced", layout, tmp_path) as region:
        region._prefault = module.Prefault(lambda: Pacer(clock, pause=0.001))
        assert region.prefault(sync=5 * layout.slot_stride - 1)  # five slots
        mapped = mapped_bytes(region.path)
        assert 5 * layout.slot_stride <= mapped < 6 * layout.slot_stride + 2 * PAGE
        time.sleep(0.1)
        assert mapped_bytes(region.path) == mapped  # the engine computes: nothing more
        assert not region.prefault_done(0)
        clock.busy.clear()
        assert region.prefault_done(10)
        assert mapped_bytes(region.path) >= 32 * layout.slot_stride


def test_a_workers_first_slots_are_its_shard_of_them(tmp_path: Path) -> None:
    from tiers.region import PrimaryRegion

    layout = RegionLayout(num_slots=16, shard_bytes=16 * PAGE, num_workers=2)
    with PrimaryRegion.create("shard-sync", layout, tmp_path) as region:
        ranges = list(slot_ranges(region.address, layout, 1, 0, 4))
        assert sum(length for _, length in ranges) == 4 * 16 * PAGE  # its half of four slots
        assert region.prefault(rank=1, sync=4 * layout.slot_stride) and region.prefault_done(10)
        assert 16 * 16 * PAGE <= mapped_bytes(region.path) < 16 * 20 * PAGE


def mapped_bytes(path: Path) -> int:
    """Resident bytes of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's first line
            inside = line.endswith(str(path))
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total
