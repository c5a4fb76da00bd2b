"""The warm start (`primary.warm_start`): a restarted engine's primary is filled in the
background with the newest blocks the file tiers hold, on real file tiers of both layouts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.manager import HIT, MISS, PENDING, Harness, k, memory_tier
from tests.helpers.manifests import wait_for
from tiering.config import BreakerConfig, PrimaryConfig, TierConfig
from tiering.errors import TierTimeout, TierUnavailable
from tiering.keys import BlockKey
from tiering.primary import KeyState
from tiering.testing import NAMESPACE
from tiering.tier import Buffer, Tier
from tiering.tier.wrappers import FaultyTier
from tiers.file import BlockFileTier, SegmentFileTier

BLOCK = 4096


@pytest.fixture(params=["files", "segments"])
def layout(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def file_tier(path: Path, layout: str) -> Tier:
    cls = BlockFileTier if layout == "files" else SegmentFileTier
    return cls(namespace=NAMESPACE, name="nvme", path=path, min_free=0, direct=False)


def warm(blocks: int) -> PrimaryConfig:
    return PrimaryConfig(warm_start=blocks * BLOCK)


def block(i: int) -> bytes:
    return Harness.block(Harness.__new__(Harness), i)


def written(
    make: Callable[..., Harness], path: Path, layout: str, ids: range, write: str = "through"
) -> TierConfig:
    """A first engine that stored `ids` one step after another (the last the newest) in a
    write-through file tier, and stopped; the configuration of the tier for the next engine
    (`write`)."""
    through = TierConfig(name="nvme", type="file", write="through")
    h = make([(through, file_tier(path, layout))], slots=len(ids) + 2)
    for i in ids:
        h.store(i)
        h.settle()
        time.sleep(0.01)  # the files layout orders by mtime, which the kernel sets per tick
    h.close()
    return TierConfig(name="nvme", type="file", write=write)


def resident(h: Harness) -> set[int]:
    """The ids of the blocks ready in the primary."""
    with h.manager.quiet():
        return {
            i
            for i in range(64)
            if k(i) in h.manager.pool and h.manager.pool.state(k(i)) is KeyState.READY
        }


def warm_ended(h: Harness) -> Callable[[], bool]:
    warm = h.manager.warm
    return lambda: warm.budget == 0 and not warm.warming


class SlowReads(FaultyTier):
    """Every read waits on `release` (set from the test)."""

    def __init__(self, inner: Tier) -> None:
        super().__init__(inner)
        self.release = asyncio.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.reads = 0

    async def _read(self, key: BlockKey, limit: int) -> Buffer | None:
        self.loop = asyncio.get_running_loop()
        self.reads += 1
        await self.release.wait()
        return await super()._read(key, limit)

    def open(self) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self.release.set)


def test_a_restarted_engine_finds_the_newest_blocks_in_its_primary_before_any_step(
    make: Callable[..., Harness], tmp_path: Path, layout: str
) -> None:
    """Ten blocks on disk, a budget of six: the six newest are read into the primary by the
    runtime alone (the engine runs no step), with their bytes, and are hits at once; the four
    older ones stay on disk, found by a lookup as before."""
    cfg = written(make, tmp_path, layout, range(10))
    h = make([(cfg, file_tier(tmp_path, layout))], slots=24, primary=warm(6))
    wait_for(h, warm_ended(h))
    assert resident(h) == set(range(4, 10))
    for i in range(4, 10):
        assert h.manager.lookup(k(i)) is HIT
        assert h.slot_bytes(i) == h.block(i)
    h.manager.on_schedule_end()
    assert h.manager.counters["blocks_warmed"] == 6
    assert h.manager.counters["warm_batches"] == 1
    stats = h.manager.stats()["tiers"]["nvme"]
    assert stats["promotions"] == 6 and stats["promotion_failures"] == 0
    assert h.lookup_until(2, HIT)[0] is PENDING  # an older block: promoted when asked for
    assert h.slot_bytes(2) == h.block(2)


def test_a_warm_start_never_evicts_and_leaves_the_write_back_reserve_free(
    make: Callable[..., Harness], tmp_path: Path, layout: str
) -> None:
    """A budget larger than the primary: the warm start fills the free slots above the
    write-back reserve, newest first, a quarter of the primary at most at a time (the
    engine's stores keep slots they can evict), evicts nothing and then ends."""
    cfg = written(make, tmp_path, layout, range(12), write="back")
    h = make([(cfg, file_tier(tmp_path, layout))], slots=8, reserve=3, primary=warm(100))
    wait_for(h, warm_ended(h))
    assert resident(h) == set(range(7, 12))  # 8 slots, 3 kept free
    assert h.manager.pool.num_free == 3
    events = h.manager.take_events()
    assert not any(getattr(e, "removed", False) for e in events)  # nothing evicted
    h.manager.on_schedule_end()
    assert h.manager.counters["blocks_warmed"] == 5
    assert h.manager.counters["warm_batches"] == 3  # a batch takes at most a quarter of the slots
    assert h.manager.stats()["tiers"]["nvme"]["demotions"] == 0  # nothing written back


def test_blocks_the_engine_stored_meanwhile_are_not_read_again(
    make: Callable[..., Harness], tmp_path: Path, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The warm start skips blocks already in the primary: blocks the engine stored while the
    first batch (5 and 4) was being read are not read over by the next ones."""
    monkeypatch.setattr("tiering.manager.warm.WARM_BATCH_BYTES", 2 * BLOCK)
    cfg = written(make, tmp_path, layout, range(6))
    slow = SlowReads(file_tier(tmp_path, layout))
    h = make([(cfg, slow)], slots=8, primary=warm(6), promotion_deadline=30.0)
    wait_for(h, lambda: slow.reads >= 1)
    h.store(3, 2)  # the engine's own stores (the same bytes), between the warm batches
    slow.open()
    wait_for(h, warm_ended(h))
    assert resident(h) == set(range(6))
    assert slow.reads == 4  # 5, 4, then 1, 0
    h.manager.on_schedule_end()
    assert h.manager.counters["blocks_warmed"] == 4
    for i in range(6):
        assert h.slot_bytes(i) == h.block(i)


def test_the_first_tier_holding_a_block_is_the_one_it_is_read_from(
    make: Callable[..., Harness], tmp_path: Path
) -> None:
    """Two indexed tiers: the budget is taken from the first one's newest blocks, then the
    second's; a block both hold is read from the first."""
    first = written(make, tmp_path / "a", "files", range(0, 4))
    mem_cfg, mem = memory_tier(name="mem", write="back", indexed=True)
    for i in range(3, 8):
        asyncio.run(mem.put(k(i), block(i)))
    tiers = [(first, file_tier(tmp_path / "a", "files")), (mem_cfg, mem)]
    h = make(tiers, slots=10, primary=warm(7))
    wait_for(h, warm_ended(h))
    assert resident(h) == set(range(0, 4)) | {5, 6, 7}
    h.manager.on_schedule_end()
    stats = h.manager.stats()["tiers"]
    assert stats["nvme"]["promotions"] == 4 and stats["mem"]["promotions"] == 3
    for i in range(8):
        if i in resident(h):
            assert h.slot_bytes(i) == h.block(i)


def test_a_request_for_a_block_being_warmed_waits_on_that_read(
    make: Callable[..., Harness], tmp_path: Path, layout: str
) -> None:
    """While a warm batch is in flight the engine is not kept stepping for it and no idle
    wait is claimed for it; once a lookup asks for one of its blocks, that lookup answers
    PENDING (no second read), the request claims the engine's wait and its steps, and the
    block is a hit when the batch lands."""
    cfg = written(make, tmp_path, layout, range(4))
    slow = SlowReads(file_tier(tmp_path, layout))
    h = make([(cfg, slow)], slots=16, primary=warm(4), promotion_deadline=30.0)
    wait_for(h, lambda: h.manager.warm.warming)
    wait_for(h, lambda: slow.reads >= 1)
    assert not h.manager.has_pending_work()  # the warm batch alone keeps no step going
    with h.manager.quiet():
        assert not h.manager.bookkeeping.urgent()
    assert h.manager.lookup(k(2)) is PENDING
    assert h.manager.bookkeeping.urgent()  # a request now waits on the warm batch
    h.manager.on_schedule_end()
    assert h.manager.has_pending_work()
    slow.open()
    h.lookup_until(2, HIT)
    assert h.slot_bytes(2) == h.block(2)
    wait_for(h, warm_ended(h))
    assert slow.reads == 4  # each block read once
    assert resident(h) == set(range(4))


class FailingBatches(FaultyTier):
    """`get_many` fails as a whole (the tier is down), counting its calls."""

    def __init__(self, inner: Tier) -> None:
        super().__init__(inner)
        self.batches = 0

    async def get_many(self, items: Any) -> list[bool | BaseException]:
        self.batches += 1
        raise TierUnavailable("tier 'nvme': injected: down")


def test_a_warm_start_stops_when_its_tier_fails(
    make: Callable[..., Harness], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A warm batch that fails as a whole ends the warm start: its slots are freed, the next
    batches are not tried, and the engine's lookups go on."""
    monkeypatch.setattr("tiering.manager.warm.WARM_BATCH_BYTES", 4 * BLOCK)
    cfg = written(make, tmp_path, "files", range(10))
    down = FailingBatches(file_tier(tmp_path, "files"))
    h = make([(cfg, down)], slots=16, primary=warm(10))
    wait_for(h, warm_ended(h))
    time.sleep(0.05)
    assert down.batches == 1
    assert h.manager.pool.num_free == h.manager.pool.num_slots
    assert resident(h) == set()
    h.manager.on_schedule_end()
    assert h.manager.counters["warm_stopped"] == 1
    assert h.manager.counters["blocks_warmed"] == 0
    assert h.manager.lookup(k(0)) in (MISS, PENDING)
    h.manager.on_schedule_end()


def test_a_warm_start_reads_in_batches_of_at_most_warm_batch_bytes(
    make: Callable[..., Harness], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nine blocks, batches of four blocks' bytes: three batches, one in flight at a time."""
    monkeypatch.setattr("tiering.manager.warm.WARM_BATCH_BYTES", 4 * BLOCK)
    cfg = written(make, tmp_path, "files", range(9))
    h = make([(cfg, file_tier(tmp_path, "files"))], slots=12, primary=warm(9))
    wait_for(h, warm_ended(h))
    assert resident(h) == set(range(9))
    h.manager.on_schedule_end()
    assert h.manager.counters["warm_batches"] == 3


def test_a_reset_ends_the_warm_start(
    make: Callable[..., Harness], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's cache reset forgets the primary: the batch in flight is dropped and no other
    batch follows."""
    monkeypatch.setattr("tiering.manager.warm.WARM_BATCH_BYTES", 2 * BLOCK)
    cfg = written(make, tmp_path, "files", range(6))
    slow = SlowReads(file_tier(tmp_path, "files"))
    h = make([(cfg, slow)], slots=8, primary=warm(6), promotion_deadline=30.0)
    wait_for(h, lambda: slow.reads >= 1)
    slow.open()
    h.manager.reset()
    time.sleep(0.1)
    assert resident(h) == set()
    assert slow.reads == 2  # the first batch only
    assert h.manager.warm.budget == 0 and not h.manager.warm.warming


@pytest.mark.parametrize("case", ["no_budget", "unindexed"])
def test_no_warm_start_without_a_budget_or_an_indexed_tier(
    make: Callable[..., Harness], tmp_path: Path, case: str
) -> None:
    """The default budget is 0; a tier without an index (Redis, S3) is never listed."""
    cfg = written(make, tmp_path, "files", range(4))
    if case == "no_budget":
        h = make([(cfg, file_tier(tmp_path, "files"))], slots=8)
    else:
        mem_cfg, mem = memory_tier(name="mem")  # unindexed
        asyncio.run(mem.put(k(1), block(1)))
        h = make([(mem_cfg, mem)], slots=8, primary=warm(4))
    time.sleep(0.1)
    assert resident(h) == set()
    assert h.manager.warm.budget == 0


class Sleepy(FaultyTier):
    """Every read takes `seconds`."""

    def __init__(self, inner: Tier, seconds: float) -> None:
        super().__init__(inner)
        self.seconds = seconds
        self.reads = 0

    async def _read(self, key: BlockKey, limit: int) -> Buffer | None:
        self.reads += 1
        await asyncio.sleep(self.seconds)
        return await super()._read(key, limit)


def indexed_mem(n: int, write: str = "through") -> tuple[Any, Any]:
    cfg, mem = memory_tier(name="mem", write=write, indexed=True)
    for i in range(n):
        asyncio.run(mem.put(k(i), block(i)))
    return cfg, mem


def slow_writes(seconds: float) -> tuple[Any, Any]:
    """A write-through tier without an index (not warmed) whose writes take `seconds`: some
    other job in flight, as a real engine has."""
    cfg, mem = memory_tier(name="remote", write="through")
    return cfg, FaultyTier(mem, delay=1.0, delay_seconds=seconds)


def warm_batches(h: Harness) -> float:
    with h.manager.quiet():
        return h.manager.counters["warm_batches"]


def test_no_warm_batch_is_submitted_once_reset_began(
    make: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    """reset() drains the jobs in flight without the lock; meanwhile each tick applies the
    warm batch that ended and submits the next one, so the warm start goes on (and prolongs
    the drain) until reset takes the lock. The design says a reset ends it."""
    monkeypatch.setattr("tiering.manager.warm.WARM_BATCH_BYTES", BLOCK)
    cfg, mem = indexed_mem(40)
    rcfg, remote = slow_writes(0.3)
    h = make(
        [(cfg, Sleepy(mem, 0.01)), (rcfg, remote)],
        slots=48,
        primary=warm(40),
        promotion_deadline=30.0,
    )
    h.store(45)  # its write-through demotion to `remote` takes 0.3 s
    h.manager.on_schedule_end()
    wait_for(h, lambda: h.manager.warm.warming)
    before = warm_batches(h)
    h.manager.reset(drain_timeout=5.0)
    time.sleep(0.05)
    assert warm_batches(h) - before == 0


def test_no_warm_batch_is_submitted_once_shutdown_began(
    make: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    """shutdown()'s flush waits on runtime.pending() without the lock; the warm start keeps
    reading (useless reads, on the medium the flush writes to) until the flush ends, and a
    batch may still be in flight when the tiers are closed."""
    monkeypatch.setattr("tiering.manager.warm.WARM_BATCH_BYTES", BLOCK)
    cfg, mem = indexed_mem(60)
    rcfg, remote = slow_writes(0.3)
    h = make(
        [(cfg, Sleepy(mem, 0.01)), (rcfg, remote)],
        slots=64,
        primary=warm(60),
        promotion_deadline=30.0,
    )
    h.store(62)  # queued for the write-through tiers: the flush writes it (0.3 s)
    wait_for(h, lambda: h.manager.warm.warming)
    before = warm_batches(h)
    h.manager.shutdown(flush=5.0)
    assert h.manager.counters["warm_batches"] - before == 0


def test_a_late_warm_batch_nobody_asked_for_keeps_no_step_going(
    make: Callable[..., Harness],
) -> None:
    """A warm batch past its deadline (the manager's clock) that no lookup asked for: the
    engine waits on nothing, so has_pending_work() must stay False (vLLM steps while True)."""
    now = [1000.0]
    cfg, mem = indexed_mem(4)
    slow = SlowReads(mem)
    h = make([(cfg, slow)], slots=8, primary=warm(4), promotion_deadline=30.0, clock=lambda: now[0])
    wait_for(h, lambda: slow.reads >= 1)
    assert not h.manager.has_pending_work()
    now[0] += 60.0  # past the batch's deadline; the tier has not let go yet
    wait_for(h, lambda: bool(h.manager.promoter.late))
    with h.manager.quiet():
        assert not h.manager.bookkeeping.urgent()
    try:
        assert not h.manager.has_pending_work()
    finally:
        slow.open()


class Bandwidth(FaultyTier):
    """A working tier that reads `per_block` seconds per block of a batch (a disk's rate)."""

    def __init__(self, inner: Tier, per_block: float) -> None:
        super().__init__(inner)
        self.per_block = per_block

    async def get_many(self, items: Any) -> Any:
        items = list(items)
        await asyncio.sleep(self.per_block * len(items))
        return await super().get_many(items)


def test_a_slow_but_healthy_tier_is_warmed(
    make: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A warm batch's deadline is not the promotion deadline (0.2 s, for a request waiting)
    but its bytes at `WARM_MIN_RATE`: a tier reading 12 blocks in 0.1 s is warmed from, and
    its measured time per block (the `auto` gate's) is not the bulk read's."""
    monkeypatch.setattr("tiering.manager.warm.WARM_MIN_RATE", 12 * BLOCK / 0.5)
    cfg, mem = indexed_mem(40)
    h = make([(cfg, Bandwidth(mem, 0.008))], slots=48, primary=warm(40), promotion_deadline=0.2)
    wait_for(h, lambda: h.manager.warm.budget == 0 and not h.manager.warm.warming)
    h.manager.on_schedule_end()
    c = h.manager.counters
    assert (c["warm_stopped"], c["blocks_warmed"]) == (0, 40)
    assert h.manager.tiers[0].seconds_per_block is None


def test_warm_batches_do_not_open_the_tiers_latency_breaker(
    make: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `faults.breaker.latency` set, each bulk warm batch slower than it counts as a
    breaker failure: a few in a row open the tier's breaker, which then refuses the engine's
    own promotions (and demotions) for `cooldown`, and the warm start stops."""
    import tests.helpers.manager as tm

    def breaker(failures: int) -> BreakerConfig:
        return BreakerConfig(failures=3, latency=0.02)

    monkeypatch.setattr(tm, "BreakerConfig", breaker)
    monkeypatch.setattr("tiering.manager.warm.WARM_BATCH_BYTES", 8 * BLOCK)
    cfg, mem = indexed_mem(40)
    h = make([(cfg, Bandwidth(mem, 0.004))], slots=48, primary=warm(40), promotion_deadline=2.0)
    wait_for(h, lambda: h.manager.warm.budget == 0 and not h.manager.warm.warming)
    h.manager.on_schedule_end()
    assert h.runtime.breaker_state("mem") == "closed"
    assert h.manager.counters["blocks_warmed"] == 40


class OneSlowRead(FaultyTier):
    """The first read of block 2 fails as a tier call past its deadline would."""

    def __init__(self, inner: Tier) -> None:
        super().__init__(inner)
        self.reads: list[BlockKey] = []

    async def _read(self, key: BlockKey, limit: int) -> Buffer | None:
        self.reads.append(key)
        if key == k(2) and self.reads.count(key) == 1:
            raise TierTimeout("tier 'nvme': injected: no answer within the deadline")
        return await super()._read(key, limit)


def test_a_block_whose_read_failed_alone_is_read_once_more(
    make: Callable[..., Harness], tmp_path: Path
) -> None:
    """Beside a starting engine a tier call can pass its deadline: a block whose warm read
    failed alone (the batch did not fail as a whole) is queued once more, and is warmed."""
    cfg = written(make, tmp_path, "files", range(4))
    tier = OneSlowRead(file_tier(tmp_path, "files"))
    h = make([(cfg, tier)], slots=16, primary=warm(4))
    wait_for(h, warm_ended(h))
    assert resident(h) == set(range(4))
    assert tier.reads.count(k(2)) == 2 and len(tier.reads) == 5
    h.manager.on_schedule_end()
    assert h.manager.counters["blocks_warmed"] == 4
    assert h.manager.counters["warm_retries"] == 1
    assert h.slot_bytes(2) == h.block(2)


class BrokenListing(FaultyTier):
    """A third-party indexed tier whose `newest` raises."""

    def newest(self, n: int) -> list[BlockKey]:
        raise RuntimeError("listing is broken")


def test_a_tier_whose_listing_fails_is_left_out_and_the_engine_starts(
    make: Callable[..., Harness], tmp_path: Path
) -> None:
    """The plan is made while the engine starts: a tier's bug there is logged, that tier is
    not warmed from, the next one is, and lookups find the first tier's blocks as before."""
    cfg = written(make, tmp_path / "a", "files", range(3))
    mem_cfg, mem = memory_tier(name="mem", write="back", indexed=True)
    asyncio.run(mem.put(k(7), block(7)))
    tiers = [(cfg, BrokenListing(file_tier(tmp_path / "a", "files"))), (mem_cfg, mem)]
    h = make(tiers, slots=16, primary=warm(8))
    wait_for(h, warm_ended(h))
    assert resident(h) == {7}
    assert h.lookup_until(1, HIT)[0] is PENDING
    assert h.slot_bytes(1) == h.block(1)
