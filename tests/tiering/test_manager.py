"""TieringOffloadingManager with memory tiers (FaultyTier, Mock(wraps=...)) on a real runtime."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tests.helpers.manager import (
    BLOCK,
    HIT,
    MISS,
    PENDING,
    RETRY,
    Harness,
    UnindexedMemoryTier,
    hog,
    k,
    memory_tier,
    spied,
)
from tests.tiers.memory_hooks import plant, stored
from tiering.config import ShutdownConfig, TierConfig
from tiering.keys import BlockKey
from tiering.manager import TierEvent
from tiering.metrics import MetricsServer
from tiering.runtime import Job
from tiering.testing import NAMESPACE
from tiering.tier import Tier
from tiering.tier.wrappers import FaultyTier
from tiers.memory import MemoryTier


@pytest.fixture
def through(make: Callable[..., Harness]) -> tuple[Harness, MemoryTier]:
    """A harness over one write-through memory tier without an index (like Redis or S3)."""
    cfg, tier = memory_tier()
    return make([(cfg, tier)]), tier


def test_without_tiers_the_primary_answers_alone(make: Callable[..., Harness]) -> None:
    h = make([])
    h.store(1)
    assert h.manager.lookup(k(1)) is HIT and h.manager.lookup(k(2)) is MISS


def test_another_thread_waits_for_the_step_and_may_end_it(
    through: tuple[Harness, MemoryTier], caplog: pytest.LogCaptureFixture
) -> None:
    """The scheduler's thread holds the lock for its step; a call from another thread
    (`stats`, `take_events`, `prepare_store`) waits for that step to end instead of running
    inside it unlocked, and a cleanup thread's `shutdown` ends a step left open and stops the
    manager (the tiers and the runtime are its opener's to close)."""
    h, _tier = through
    h.store(1)
    assert h.manager.lookup(k(1)) is HIT  # the step begins, on this thread
    answers: list[Any] = []
    other = threading.Thread(
        target=lambda: answers.append((h.manager.stats(), h.manager.prepare_store([k(2)])))
    )
    other.start()
    other.join(0.2)
    assert other.is_alive() and not answers  # waits for the step
    h.manager.on_schedule_end()
    other.join(5)
    assert not other.is_alive() and answers[0][1] is not None
    assert h.manager.lookup(k(1)) is HIT  # a new step, left open
    with caplog.at_level(logging.WARNING, logger="tiering.manager.steplock"):
        closer = threading.Thread(target=h.manager.shutdown)
        closer.start()
        closer.join(10)
    assert not closer.is_alive()
    assert "ended by another thread" in caplog.text
    assert h.manager.bookkeeping.closed and h.manager.bookkeeping.on_tick not in h.runtime._hooks
    assert not h.runtime._closed and not _tier._closed  # the harness's, closed by it
    h.close()
    assert h.runtime._closed and _tier._closed


def test_write_through_demotes_each_stored_block(through: tuple[Harness, MemoryTier]) -> None:
    h, tier = through
    h.store(1, 2)
    h.settle()
    assert stored(tier, k(1)) is not None and stored(tier, k(2)) is not None
    assert h.manager.pool.ref_count(k(1)) == 0  # unpinned once written
    events = [e for e in h.manager.take_events() if isinstance(e, TierEvent)]
    assert {key for e in events for key in e.keys} == {k(1), k(2)} and events[0].tier == "mem"


def test_a_secondary_hit_is_promoted_and_served(through: tuple[Harness, MemoryTier]) -> None:
    h, tier = through
    h.demote_and_forget(1)  # the primary forgets; the tier keeps the block
    assert h.manager.lookup(k(1)) is RETRY  # existence unknown yet: ask again next step
    seen = h.lookup_until(1, HIT)
    assert PENDING in seen
    assert h.slot_bytes(1) == h.block(1)
    assert h.manager.stats()["tiers"]["mem"]["promotions"] == 1


def test_one_promotion_serves_every_request_and_checks_are_batched(
    make: Callable[..., Harness],
) -> None:
    cfg, inner = memory_tier()
    tier = spied(inner)
    h = make([(cfg, tier)])
    for i in range(5):
        plant(inner, k(i), b"")  # presence is enough for the check
    for _ in range(3):  # three requests look the same five keys up in one step
        assert [h.manager.lookup(k(i)) for i in range(5)] == [RETRY] * 5
    h.manager.on_schedule_end()
    h.settle(1)
    assert tier.contains.call_count == 1 and len(tier.contains.call_args.args[0]) == 5


def test_absent_blocks_are_misses_and_not_asked_again_every_step(
    make: Callable[..., Harness],
) -> None:
    cfg, inner = memory_tier()
    tier = spied(inner)
    h = make([(cfg, tier)])
    h.lookup_until(9, MISS)
    calls = tier.contains.call_count
    for _ in range(5):
        assert h.manager.lookup(k(9)) is MISS
        h.settle(1)
    assert tier.contains.call_count == calls


def test_failed_promotion_frees_the_slot_and_is_a_miss(make: Callable[..., Harness]) -> None:
    cfg, inner = memory_tier()
    faulty = FaultyTier(inner)
    h = make([(cfg, faulty)])
    h.demote_and_forget(1)
    assert h.manager.lookup(k(1)) is RETRY
    h.settle(1)
    faulty.corrupt = 1.0  # the block arrives damaged: verification refuses it
    assert h.manager.lookup(k(1)) is PENDING
    h.settle()
    assert h.manager.lookup(k(1)) is MISS
    assert h.manager.pool.num_used == 0 and h.manager.pool.num_writing == 0
    assert h.manager.stats()["tiers"]["mem"]["promotion_failures"] == 1


def test_an_indexed_tier_is_promoted_from_without_existence_checks(
    make: Callable[..., Harness],
) -> None:
    cfg, inner = memory_tier(indexed=True)
    tier = spied(inner)
    h = make([(cfg, tier)])
    h.demote_and_forget(1, 2)
    # The tier knows what it holds: a hit is pending at once, a block it lacks a miss at once.
    assert [h.manager.lookup(k(i)) for i in (1, 2, 3)] == [PENDING, PENDING, MISS]
    h.settle(1)
    assert h.manager.lookup(k(1)) is HIT and h.slot_bytes(2) == h.block(2)
    assert tier.contains.call_count == 0
    assert tier.get_many.call_count == 1  # one batch for the step's promotions


def test_a_block_the_tier_holds_is_not_demoted_again(make: Callable[..., Harness]) -> None:
    cfg, tier = memory_tier(write="back", indexed=True)
    h = make([(cfg, tier)], slots=4, reserve=1)
    h.store(1, 2, 3, 4)
    h.settle()  # the least recent block is reclaimed and demoted
    assert stored(tier, k(1)) is not None
    assert h.lookup_until(1, HIT)[-1] is HIT  # promoted back
    for i in range(5, 12):  # newer blocks push it out of the primary again
        h.store(i)
        h.settle()
        if h.manager.pool.lookup(k(1)) is MISS:
            break
    assert h.manager.pool.lookup(k(1)) is MISS
    demoted = [key for e in h.manager.take_events() if isinstance(e, TierEvent) for key in e.keys]
    assert demoted.count(k(1)) == 1  # written to the tier once
    assert h.manager.stats()["tiers"]["mem"]["demotions_skipped"] == 1
    assert h.manager.pool.num_held == 0  # its slot went back to the free list at once


def test_promotions_without_room_are_misses_the_next_step(make: Callable[..., Harness]) -> None:
    cfg, tier = memory_tier(indexed=True)
    h = make([(cfg, tier)], slots=4)
    h.demote_and_forget(0, 1, 2, 3)
    h.store(10, 11, 12)  # the engine's blocks, still being written: 1 slot left
    h.manager.prepare_store([k(13)])
    assert [h.manager.lookup(k(i)) for i in range(2)] == [PENDING, PENDING]
    h.end_step()  # no slot for them: nothing evictable
    assert [h.manager.lookup(k(i)) for i in range(2)] == [MISS, MISS]
    assert h.manager.counters["promotion_allocation_failures"] == 2
    assert not h.manager.promoting
    h.manager.on_schedule_end()
    assert h.manager.lookup(k(0)) is PENDING  # asked again once the step is over


class StubbornMemoryTier(MemoryTier):
    """Reads that cannot be stopped once started (like the file tier's pool threads writing
    into a slot): a cancelled read still runs to its end before the call returns."""

    async def _read(self, key: BlockKey, limit: int) -> bytes | None:
        work = asyncio.ensure_future(asyncio.sleep(0.6))
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            await work
            raise
        return self._index.get(key)


def test_a_late_promotion_is_a_miss_and_keeps_its_slot_until_the_tier_lets_go(
    make: Callable[..., Harness],
) -> None:
    cfg = TierConfig(name="mem", type="memory", write="back")
    tier = StubbornMemoryTier(namespace=NAMESPACE, name="mem")
    h = make([(cfg, tier)], slots=4, reserve=1, promotion_deadline=0.2)
    plant(tier, k(1), tier._encode(k(1), h.block(1))[1][0] + h.block(1))
    assert h.manager.lookup(k(1)) is PENDING
    h.manager.on_schedule_end()  # the promotion starts
    time.sleep(0.3)  # past its deadline, the read still running
    assert h.manager.lookup(k(1)) is MISS  # recompute rather than wait
    assert h.manager.pool.lookup(k(1)) is PENDING  # the slot is still the tier's
    assert h.manager.counters["promotions_late"] == 1
    deadline = time.monotonic() + 5
    while h.manager.has_pending_work() and time.monotonic() < deadline:
        time.sleep(0.01)
    h.settle(1)
    assert h.manager.pool.lookup(k(1)) is MISS and h.manager.pool.num_writing == 0
    assert h.manager.stats()["tiers"]["mem"]["promotion_failures"] == 1


def test_a_reset_that_a_job_outlives_keeps_its_slot_out_of_use_until_it_ends(
    make: Callable[..., Harness],
) -> None:
    cfg = TierConfig(name="mem", type="memory", write="back")
    tier = StubbornMemoryTier(namespace=NAMESPACE, name="mem")
    h = make([(cfg, tier)], slots=4, reserve=1)
    plant(tier, k(1), tier._encode(k(1), h.block(1))[1][0] + h.block(1))
    assert h.manager.lookup(k(1)) is PENDING
    h.manager.on_schedule_end()
    time.sleep(0.1)  # the promotion's read into its slot has started (it takes 0.6 s)
    reading = h.manager.pool.slot(k(1))
    h.manager.reset(drain_timeout=0.05)  # gives up waiting for it
    assert h.manager.pool.num_free == 3 and h.manager.counters["reset_slots_quarantined"] == 1
    h.store(10, 11, 12)  # every free slot: none is the one being read into
    assert reading not in {h.manager.pool.slot(k(i)) for i in (10, 11, 12)}
    assert h.manager.prepare_store([k(13)]) is not None  # ...by eviction, not that slot
    assert h.manager.pool.slot(k(13)) != reading
    deadline = time.monotonic() + 5
    while h.manager.pool.num_held and time.monotonic() < deadline:
        h.settle(1)
    assert h.manager.pool.num_held == 0  # the read ended: the slot is back


def test_a_fenced_reset_keeps_the_engines_slots_out_of_use_until_reset_flushed(
    make: Callable[..., Harness],
) -> None:
    h = make([], slots=4)
    pool = h.manager.pool
    h.store(1)  # ready
    assert h.manager.prepare_store([k(2)]) is not None  # the engine's store still in flight
    writing = pool.slot(k(2))
    assert h.manager.prepare_load([k(1)]) == [pool.slot(k(1))]  # the engine's load in flight
    reading = pool.slot(k(1))
    h.manager.on_schedule_end()
    h.manager.reset(fence=True)  # vLLM 0.33: its copies may still run until on_reset_flushed
    assert pool.num_free == 2 and h.manager.counters["reset_slots_fenced"] == 2
    grant = h.manager.prepare_store([k(3), k(4)])
    assert grant is not None and {writing, reading}.isdisjoint(grant.slots)
    assert h.manager.prepare_store([k(5)]) is None  # nothing else: the fenced slots stay out
    h.manager.reset_flushed()
    assert pool.num_free == 2 and pool.num_held == 0
    h.manager.reset_flushed()  # a second call changes nothing
    assert pool.num_free == 2


def test_an_unfenced_reset_frees_every_slot_at_once(make: Callable[..., Harness]) -> None:
    h = make([], slots=4)
    assert h.manager.prepare_store([k(2)]) is not None
    h.manager.reset()
    assert h.manager.pool.num_free == 4


def test_a_reset_fenced_for_some_steps_frees_its_slots_after_them(
    make: Callable[..., Harness],
) -> None:
    h = make([], slots=4)
    assert h.manager.prepare_store([k(2)]) is not None  # the engine's store in flight
    h.manager.reset(fence=True, fence_steps=3)  # vLLM 0.32: it flushes in the next step
    for _ in range(2):
        h.manager.on_schedule_end()
        assert h.manager.pool.num_free == 3
    h.manager.on_schedule_end()
    assert h.manager.pool.num_free == 4 and h.manager.pool.num_held == 0
    h.manager.on_schedule_end()
    assert h.manager.pool.num_free == 4


def test_a_failed_promotion_that_was_pending_is_removed_metadata_only(
    make: Callable[..., Harness],
) -> None:
    cfg, inner = memory_tier()
    faulty = FaultyTier(inner)
    h = make([(cfg, faulty)])
    h.demote_and_forget(1, 2)
    h.manager.take_events()
    assert h.manager.lookup(k(1)) is RETRY and h.manager.lookup(k(2)) is RETRY
    h.settle(1)
    assert h.manager.lookup(k(1)) is PENDING and h.manager.lookup(k(2)) is PENDING
    assert h.manager.promoted_from(k(1)) is faulty
    assert h.manager.promoted_from(k(7)) is None
    faulty.corrupt = 1.0  # both arrive damaged
    h.settle()
    assert h.manager.lookup(k(1)) is MISS
    assert h.manager.promoted_from(k(1)) is None
    events = [e for e in h.manager.take_events() if not isinstance(e, TierEvent)]
    assert [(set(e.keys), e.removed, e.metadata_only) for e in events] == [
        ({k(1), k(2)}, True, True)
    ]
    assert h.manager.take_events() == []


def test_a_failed_promotion_of_a_block_resident_again_is_not_removed(
    make: Callable[..., Harness],
) -> None:
    cfg, inner = memory_tier()
    faulty = FaultyTier(inner)
    h = make([(cfg, faulty)])
    h.demote_and_forget(1)
    h.manager.lookup(k(1))
    h.settle(1)
    assert h.manager.lookup(k(1)) is PENDING
    faulty.corrupt = 1.0
    h.settle()
    faulty.corrupt = 0.0
    h.store(1)  # the engine computed and stored it again before the events were taken
    events = h.manager.take_events()
    assert not any(getattr(e, "metadata_only", False) for e in events)


def test_a_key_pending_again_from_another_tier_is_not_removed(
    make: Callable[..., Harness],
) -> None:
    a_inner, b = (MemoryTier(namespace=NAMESPACE, name=name) for name in "ab")
    a = FaultyTier(a_inner)
    h = make(
        [
            (TierConfig(name="a", type="memory", write="through"), a),
            (TierConfig(name="b", type="memory", write="through"), b),
        ]
    )
    for tier in (a_inner, b):
        plant(tier, k(1), tier._encode(k(1), h.block(1))[1][0] + h.block(1))
    h.manager.take_events()
    a.corrupt = 1.0
    assert h.manager.lookup(k(1)) is PENDING and h.manager.promoted_from(k(1)) is a
    h.settle()  # a's copy arrives damaged
    h.lookup_until(1, PENDING)
    assert h.manager.promoted_from(k(1)) is b  # PENDING again: vLLM records it resident
    h.runtime.submit(Job("busy", lambda: hog(0.2), 5.0))  # b's promotion not allocated yet
    time.sleep(0.02)
    h.manager.on_schedule_end()
    events = [e for e in h.manager.take_events() if not isinstance(e, TierEvent)]
    assert not any(e.metadata_only for e in events), events
    h.settle()
    assert h.manager.lookup(k(1)) is HIT


def test_a_second_fenced_reset_counts_only_new_slots_and_one_flush_frees_all(
    make: Callable[..., Harness],
) -> None:
    h = make([], slots=4)
    assert h.manager.prepare_store([k(1)]) is not None
    h.manager.reset(fence=True)
    assert h.manager.prepare_store([k(2)]) is not None
    h.manager.reset(fence=True)  # vLLM 0.33 merges the fences: one on_reset_flushed
    assert h.manager.pool.num_free == 2 and h.manager.counters["reset_slots_fenced"] == 2
    h.manager.reset_flushed()
    assert h.manager.pool.num_free == 4 and h.manager.pool.num_held == 0


def test_every_counter_exists_at_zero_from_the_start(make: Callable[..., Harness]) -> None:
    h = make([memory_tier("a"), memory_tier("b")])
    stats = h.manager.stats()
    for name in ("lookups", "found", "promotions", "demotion_failures", "bytes_promoted"):
        assert stats["tiers"]["a"][name] == 0 and stats["tiers"]["b"][name] == 0
    assert stats["manager"]["promotions_late"] == 0
    assert stats["manager"]["demotions_dropped_direct_eviction"] == 0


def test_a_broken_tier_never_raises_into_the_caller(make: Callable[..., Harness]) -> None:
    cfg, inner = memory_tier()
    faulty = FaultyTier(inner, fail=1.0)
    h = make([(cfg, faulty)])
    h.store(1, 2)  # demotions fail
    results = h.lookup_until(7, MISS)  # checks fail: a miss
    assert results[-1] is MISS
    h.settle()
    stats = h.manager.stats()["tiers"]["mem"]
    assert stats["errors"] >= 1 and stats["demotion_failures"] == 2
    assert h.manager.pool.ref_count(k(1)) == 0  # pins released after the failure


def test_write_back_reclaims_least_recent_blocks_and_brings_them_back(
    make: Callable[..., Harness],
) -> None:
    cfg, tier = memory_tier(write="back")
    h = make([(cfg, tier)], slots=8, reserve=3)
    h.store(*range(6))  # 2 slots free, reserve 3: the oldest block is demoted and reclaimed
    h.settle()
    assert stored(tier, k(0)) is not None
    assert h.manager.pool.lookup(k(0)) is MISS and h.manager.pool.num_free >= 3
    assert h.lookup_until(0, HIT)[-1] is HIT
    assert h.slot_bytes(0) == h.block(0)


def test_a_block_looked_up_as_hit_is_not_reclaimed_before_the_steps_load(
    make: Callable[..., Harness],
) -> None:
    cfg, tier = memory_tier(write="back", indexed=True)
    h = make([(cfg, tier)], slots=8, reserve=8)  # the runtime reclaims every block it can
    h.store(0, 1)
    h.runtime.submit(Job("busy", lambda: hog(0.1), 5.0))  # the runtime's thread is busy
    time.sleep(0.02)
    h.manager.on_schedule_end()  # the runtime is to reclaim both blocks between steps...
    assert h.manager.lookup(k(0)) is HIT  # ...but the next step began first
    time.sleep(0.2)  # the runtime is free and tries: it must wait for the step's end
    assert h.manager.prepare_load([k(0)]) == [h.manager.pool.slot(k(0))]
    h.end_step()  # between steps: block 1 is demoted and its slot reclaimed; 0 is pinned
    assert h.manager.pool.lookup(k(1)) is MISS and stored(tier, k(1)) is not None
    assert h.manager.pool.lookup(k(0)) is HIT
    h.manager.complete_load([k(0)])


def test_the_scheduler_does_the_runtimes_work_when_it_missed_the_window(
    make: Callable[..., Harness],
) -> None:
    cfg, tier = memory_tier(write="back", indexed=True)
    h = make([(cfg, tier)], slots=8, reserve=8)
    h.store(0, 1)
    h.runtime.submit(Job("busy", lambda: hog(0.2), 5.0))  # the runtime's thread is busy...
    time.sleep(0.02)
    h.manager.on_schedule_end()
    h.manager.lookup(k(5))  # ...until the next step has begun: it missed the window
    h.manager.on_schedule_end()  # so this step's end does the work itself
    assert h.manager.counters["bookkeeping_on_scheduler"] == 1
    assert h.manager.pool.lookup(k(0)) is MISS and h.manager.pool.lookup(k(1)) is MISS
    h.settle()
    assert stored(tier, k(0)) is not None and stored(tier, k(1)) is not None


def test_selective_demotes_only_blocks_hit_often_enough(make: Callable[..., Harness]) -> None:
    cfg, tier = memory_tier(write="selective", admit_after_hits=2)
    h = make([(cfg, tier)], slots=4, reserve=4)
    h.store(1, 2)
    for _ in range(2):
        h.manager.prepare_load([k(2)])
        h.manager.complete_load([k(2)])
    h.settle()
    assert stored(tier, k(2)) is not None and stored(tier, k(1)) is None


def test_a_named_admission_policy_replaces_the_implied_ones(
    make: Callable[..., Harness],
) -> None:
    cfg, tier = memory_tier(write="back", admission="min-hits", admit_after_hits=1)
    h = make([(cfg, tier)], slots=4, reserve=4)
    h.store(1, 2)
    h.manager.prepare_load([k(2)])
    h.manager.complete_load([k(2)])
    h.settle()
    assert stored(tier, k(2)) is not None and stored(tier, k(1)) is None


def test_min_age_keeps_young_blocks_off_the_tier(make: Callable[..., Harness]) -> None:
    cfg, tier = memory_tier(write="back", min_age=3600.0)
    h = make([(cfg, tier)], slots=4, reserve=4)
    h.store(1, 2)
    h.settle()
    assert stored(tier, k(1)) is None and h.manager.pool.num_free == 4  # reclaimed, not demoted


def test_a_slow_tier_never_blocks_and_drops_are_counted(make: Callable[..., Harness]) -> None:
    cfg, inner = memory_tier()
    slow = FaultyTier(inner, delay=1.0, delay_seconds=1.5)
    h = make([(cfg, slow)], slots=64, max_inflight=4)
    start = time.monotonic()
    for i in range(0, 40, 4):  # ten steps
        h.store(i, i + 1, i + 2, i + 3)
        h.manager.on_schedule_end()
    assert time.monotonic() - start < 0.5  # the store path never waited on the tier
    dropped = 0.0
    while dropped < 36 and time.monotonic() - start < 1.0:  # the tier answers after 1.5 s
        time.sleep(0.01)
        dropped = h.manager.stats()["tiers"]["mem"].get("demotions_dropped", 0)
    assert dropped == 36 and h.manager.stats()["tiers"]["mem"]["inflight_demotions"] == 4


def test_auto_gate_refuses_a_tier_slower_than_recomputing(make: Callable[..., Harness]) -> None:
    cfg, tier = memory_tier()
    h = make([(cfg, tier)], gate="auto", prefill_rate=1e12)  # recomputing is instant
    h.demote_and_forget(1, 2)
    h.lookup_until(1, HIT)  # nothing measured yet: the first promotion goes
    h.lookup_until(2, MISS)  # now measured slower than recomputing: refused
    assert h.manager.stats()["tiers"]["mem"]["gated"] >= 1


def test_reset_drains_jobs_and_leaks_no_pins(make: Callable[..., Harness]) -> None:
    cfg, inner = memory_tier()
    h = make([(cfg, FaultyTier(inner, delay=1.0, delay_seconds=0.2))])
    h.store(1, 2, 3)  # demotions in flight, slots pinned
    h.manager.reset()
    assert h.runtime.pending() == 0
    assert h.manager.pool.num_used == 0 and h.manager.pool.num_reading == 0
    h.store(4)
    h.settle()
    assert h.manager.pool.ref_count(k(4)) == 0


from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule  # noqa: E402

KEY_IDS = st.integers(min_value=0, max_value=15)


class ManagerMachine(RuleBasedStateMachine):
    """Two secondary tiers, the second one faulty; the engine's calls in any order."""

    @initialize(
        seed=st.integers(0, 1000),
        write=st.sampled_from(["through", "back", "selective"]),
        fail=st.sampled_from([0.0, 0.3]),
        corrupt=st.sampled_from([0.0, 0.3]),
    )
    def start(self, seed: int, write: str, fail: float, corrupt: float) -> None:
        first = memory_tier("first", write=write, indexed=True)
        faulty = FaultyTier(
            UnindexedMemoryTier(namespace=NAMESPACE, name="second"),
            fail=fail,
            corrupt=corrupt,
            drop=0.1,
            seed=seed,
        )
        second = (TierConfig(name="second", type="memory", write="through"), faulty)
        self.h = Harness([first, second], slots=6, reserve=2)
        self.loads: list[list[BlockKey]] = []
        self.stores: list[list[BlockKey]] = []

    def teardown(self) -> None:
        if hasattr(self, "h"):
            self.h.close()

    @rule(ids=st.lists(KEY_IDS, min_size=1, max_size=3, unique=True))
    def store(self, ids: list[int]) -> None:
        grant = self.h.manager.prepare_store([k(i) for i in ids])
        if grant is not None and grant.keys:
            self.stores.append(list(grant.keys))

    @precondition(lambda self: self.stores)
    @rule(ok=st.booleans())
    def complete_store(self, ok: bool) -> None:
        self.h.manager.complete_store(self.stores.pop(0), ok=ok)

    @rule(i=KEY_IDS)
    def lookup_and_load(self, i: int) -> None:
        if self.h.manager.lookup(k(i)) is HIT:
            self.h.manager.prepare_load([k(i)])
            self.loads.append([k(i)])

    @precondition(lambda self: self.loads)
    @rule()
    def complete_load(self) -> None:
        self.h.manager.complete_load(self.loads.pop(0))

    @rule()
    def step(self) -> None:
        self.h.settle(1)

    @rule()
    def drain(self) -> None:
        """Every promotion ends, and nothing stays pinned or held once the tiers are idle."""
        self.h.settle(3)
        manager, pool = self.h.manager, self.h.manager.pool
        assert not manager.promoting
        assert pool.num_held == 0
        assert pool.num_reading == len({key for batch in self.loads for key in batch})

    @rule()
    def reset(self) -> None:
        self.h.manager.reset()
        self.loads.clear()
        self.stores.clear()  # vLLM never completes jobs from before a reset
        pool = self.h.manager.pool
        assert pool.num_reading == 0 and pool.num_writing == 0 and pool.num_held == 0

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "h"):
            return
        manager, pool = self.h.manager, self.h.manager.pool
        with manager.quiet():  # the runtime's thread applies results meanwhile otherwise
            assert pool.num_used + pool.num_free + pool.num_held == pool.num_slots
            ours = {key for batch in self.stores for key in batch}
            writing = {key for key in map(k, range(16)) if pool.lookup(key) is PENDING}
            # No key is pending without someone writing it: the engine (a store) or a promotion.
            assert writing <= ours | manager.promoting, writing - ours - manager.promoting
            for batch in self.loads:  # pinned blocks are never evicted
                assert all(pool.lookup(key) is HIT for key in batch)

    @invariant()
    def promotions_end(self) -> None:
        if not hasattr(self, "h") or self.h.manager.has_pending_work():
            return
        assert not self.h.manager.promoting or self.h.runtime.pending() == 0


ManagerMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
TestManagerMachine = ManagerMachine.TestCase


def test_prometheus_endpoint(make: Callable[..., Harness]) -> None:
    """The snapshot the manager publishes at each step's end, served as the connector serves
    it (the manager itself opens no socket)."""
    import urllib.request

    server = MetricsServer(0)  # 0: any free port
    try:
        cfg, tier = memory_tier()
        h = make([(cfg, tier)], publish=server.publish)
        h.store(1, 2)
        h.settle()
        url = f"http://127.0.0.1:{server.port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        assert 'kvtier_tier_demotions{tier="mem"} 2.0' in text
        assert 'kvtier_tier_breaker_open{tier="mem"} 0.0' in text
        assert "kvtier_primary_used 2.0" in text
    finally:
        server.close()


def test_a_tier_answering_the_wrong_number_of_items_is_a_miss(make: Callable[..., Harness]) -> None:
    class Broken(MemoryTier):
        async def _contains(self, keys: Any) -> list[bool]:
            return [True]  # one answer, whatever was asked

    cfg = TierConfig(name="broken", type="memory", write="through")
    h = make([(cfg, Broken(namespace=NAMESPACE, name="broken"))])
    for i in range(3):
        h.manager.lookup(k(i))
    assert h.lookup_until(1, MISS)[-1] is MISS  # no exception reached the caller


def test_the_segment_layout_with_kernel_aio_serves_the_runtime(
    make: Callable[..., Harness], tmp_path: Any
) -> None:
    """The file tier's segment layout on the runtime's loop (its own thread), from page-aligned
    slots as the primary region's are: blocks written back by kernel AIO and promoted back byte
    for byte, after a restart of the tier too."""
    import mmap

    from tiers.file import SegmentFileTier

    def harness() -> tuple[Harness, SegmentFileTier]:
        tier = SegmentFileTier(namespace=NAMESPACE, path=tmp_path, min_free=0, direct=True)
        h = make([(TierConfig(name="nvme", type="file", write="back"), tier)], reserve=3)
        region = mmap.mmap(-1, 8 * BLOCK)  # page-aligned slots
        h.memory = np.frombuffer(region, dtype=np.uint8).reshape(8, BLOCK)
        return h, tier

    h, tier = harness()
    h.store(*range(6))  # the oldest blocks are demoted and reclaimed
    h.settle()
    h.store(*range(6, 12))
    h.settle()
    demoted = [i for i in range(12) if tier.knows(k(i))]
    assert len(demoted) >= 6
    assert h.lookup_until(demoted[0], HIT)[-1] is HIT
    assert h.slot_bytes(demoted[0]) == h.block(demoted[0])
    assert tier.counters["aio_requests"] > 0 and tier.counters["errors"] == 0
    h.close()

    h, tier = harness()  # a restarted engine: the blocks come back from the segment files
    assert all(tier.knows(k(i)) for i in demoted)
    for i in demoted[-2:]:  # the first read opens the segment file (in the pool), then AIO
        assert h.lookup_until(i, HIT)[-1] is HIT
        assert h.slot_bytes(i) == h.block(i)
    assert tier.counters["aio_requests"] > 0


def test_a_request_larger_than_the_primary_is_said_once_with_the_numbers(
    make: Callable[..., Harness], caplog: pytest.LogCaptureFixture
) -> None:
    h = make([], slots=4)
    h.store(0)
    caplog.set_level(logging.WARNING, logger="tiering.manager")
    for _ in range(3):  # vLLM offers the same blocks again every step
        assert h.manager.prepare_store([k(i) for i in range(6)]) is None
    (record,) = [r for r in caplog.records if r.name == "tiering.manager"]
    message = record.getMessage()
    assert "a store of 6 blocks (5 not in the primary) was refused" in message
    assert "4 slots of 4096 bytes" in message and "raise primary.capacity" in message.lower()
    assert "at least 24KiB (6 slots)" in message
    assert h.manager.counters["stores_refused_too_large"] == 3
    assert h.manager.counters["store_blocks_refused"] == 15
    assert h.manager.pool.lookup(k(0)) is HIT  # nothing was evicted for it


def test_a_store_with_every_slot_pinned_is_said_once_with_the_numbers(
    make: Callable[..., Harness], caplog: pytest.LogCaptureFixture
) -> None:
    h = make([], slots=4)
    h.store(0, 1, 2, 3)
    h.manager.prepare_load([k(0), k(1), k(2)])  # being loaded: pinned
    h.manager.on_schedule_end()
    caplog.set_level(logging.WARNING, logger="tiering.manager")
    assert h.manager.prepare_store([k(3), k(10), k(11)]) is None  # k(3) is its own: kept
    assert h.manager.prepare_store([k(12), k(13)]) is None
    (record,) = [r for r in caplog.records if r.name == "tiering.manager"]
    message = record.getMessage()
    assert "a store of 3 blocks (2 not in the primary) was refused" in message
    assert "0 are free and 0 evictable; 3 are pinned" in message
    assert h.manager.counters["stores_refused_no_room"] == 2
    assert "stores_refused_too_large" not in h.manager.counters
    h.manager.complete_load([k(0), k(1), k(2)])
    assert h.manager.prepare_store([k(12), k(13)]) is not None  # room again


def test_the_gil_comes_back_sooner_while_a_promotion_is_in_flight(
    make: Callable[..., Harness],
) -> None:
    """While a request waits for a promotion, vLLM's loop spins through empty steps holding the
    GIL: the switch interval is short until the promotion has ended (`tiering.gil`)."""
    import sys

    from tiering import gil

    before = sys.getswitchinterval()
    cfg = TierConfig(name="mem", type="memory", write="back")
    tier = StubbornMemoryTier(namespace=NAMESPACE, name="mem")  # each read takes 0.6 s
    h = make([(cfg, tier)], slots=4, reserve=1)
    plant(tier, k(1), tier._encode(k(1), h.block(1))[1][0] + h.block(1))
    assert h.manager.lookup(k(1)) is PENDING
    h.manager.on_schedule_end()  # the promotion is queued: the claim starts with the step's end
    assert sys.getswitchinterval() == pytest.approx(gil.DEFAULT_INTERVAL)
    h.lookup_until(1, HIT)
    assert sys.getswitchinterval() == pytest.approx(before)
    assert gil.holders() == 0


def test_an_empty_step_waits_for_the_promotion_instead_of_spinning(
    make: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine step that schedules nothing while a promotion is in flight waits (the GIL
    released) until the promotion has been applied: the next step's lookup answers HIT."""
    from tiering.manager import offloading

    monkeypatch.setattr(offloading, "IDLE_WAIT", 5.0)  # long: the wait must end on the result
    cfg, tier = memory_tier(indexed=True, write="back")
    h = make([(cfg, tier)], slots=4, reserve=1)
    plant(tier, k(1), tier._encode(k(1), h.block(1))[1][0] + h.block(1))
    assert h.manager.lookup(k(1)) is PENDING
    began = time.monotonic()
    h.manager.on_schedule_end(idle=True)
    assert time.monotonic() - began < 2.0
    assert h.manager.lookup(k(1)) is HIT
    assert h.slot_bytes(1) == h.block(1)
    h.manager.on_schedule_end(idle=True)  # nothing in flight: no wait
    assert h.manager.counters["idle_waits"] == 1


def test_an_empty_step_waits_at_most_idle_wait(make: Callable[..., Harness]) -> None:
    from tiering.manager.offloading import IDLE_WAIT

    cfg = TierConfig(name="mem", type="memory", write="back")
    tier = StubbornMemoryTier(namespace=NAMESPACE, name="mem")  # each read takes 0.6 s
    h = make([(cfg, tier)], slots=4, reserve=1)
    plant(tier, k(1), tier._encode(k(1), h.block(1))[1][0] + h.block(1))
    assert h.manager.lookup(k(1)) is PENDING
    h.manager.on_schedule_end(idle=True)  # the promotion starts
    waited = []
    for _ in range(3):
        assert h.manager.lookup(k(1)) is PENDING
        began = time.monotonic()
        h.manager.on_schedule_end(idle=True)
        waited.append(time.monotonic() - began)
    assert all(IDLE_WAIT * 0.8 <= w < IDLE_WAIT + 0.1 for w in waited), waited
    assert h.manager.lookup(k(1)) is PENDING
    h.manager.on_schedule_end()  # a step with work: no wait
    assert h.manager.counters["idle_waits"] == 4
    h.lookup_until(1, HIT)


def test_shutdown_writes_what_write_through_tiers_were_still_to_get(
    make: Callable[..., Harness],
) -> None:
    """Blocks stored in the engine's last step are demoted between steps; an engine that stops
    right after (vLLM's offline LLM) runs no step more: shutdown writes them, and waits for the
    demotions in flight, before it stops."""
    cfg, tier = memory_tier(indexed=True)
    h = make([(cfg, tier)])
    h.store(1, 2)  # stored and completed in the last step; the step's end never comes
    h.manager.shutdown()
    assert stored(tier, k(1)) is not None and stored(tier, k(2)) is not None
    assert h.manager.stats()["tiers"]["mem"]["demotions"] == 2
    assert h.manager.stats()["tiers"]["mem"]["bytes_demoted"] == 2 * BLOCK


def file_tier(path: Any, name: str = "nvme") -> Tier:
    from tiers.file import BlockFileTier

    return BlockFileTier(namespace=NAMESPACE, name=name, path=path, min_free=0, direct=False)


def test_shutdown_writes_the_resident_blocks_to_a_write_back_tier_for_the_next_engine(
    make: Callable[..., Harness], tmp_path: Any
) -> None:
    """A write-back tier gets a block when the primary evicts it; what the primary still
    holds at shutdown goes to the write-back tiers that outlive the engine (a file tier here),
    so that the next engine finds it; a memory tier, gone with the engine, gets nothing."""
    cfg = TierConfig(name="nvme", type="file", write="back")
    mem_cfg, mem = memory_tier(name="mem", write="back", indexed=True)
    tier = file_tier(tmp_path)
    h = make([(cfg, tier), (mem_cfg, mem)], slots=8, reserve=1, max_inflight=2)
    h.store(*range(6))  # 2 slots free, reserve 1: nothing is evicted, nothing demoted
    h.settle()
    assert not any(tier.knows(k(i)) for i in range(6))
    h.manager.shutdown()
    assert all(stored(mem, k(i)) is None for i in range(6))

    h = make([(cfg, file_tier(tmp_path))], slots=8, reserve=1)  # the next engine
    for i in range(6):
        assert h.lookup_until(i, HIT)[-1] is HIT
        assert h.slot_bytes(i) == h.block(i)


def test_the_shutdown_flush_sends_each_block_once_and_ends_within_its_time(
    make: Callable[..., Harness], tmp_path: Any
) -> None:
    """A tier that fails every write is sent each block once (in rounds of `max_inflight`),
    not again until the flush's time is up; a slow one gets what fits in that time."""
    cfg = TierConfig(name="nvme", type="file", write="back")
    failing = FaultyTier(file_tier(tmp_path / "a"), fail=1.0)
    h = make([(cfg, failing)], slots=8, reserve=1, max_inflight=2)
    h.store(*range(6))
    h.settle()
    h.manager.shutdown(flush=5.0)
    assert failing.injected["fail"] == 6  # each of the six blocks once (a fault per block)

    slow = FaultyTier(file_tier(tmp_path / "b"), delay=1.0, delay_seconds=0.4)
    h = make([(cfg, slow)], slots=8, reserve=1, max_inflight=1)
    h.store(*range(6))
    h.settle()
    began = time.monotonic()
    h.manager.shutdown(flush=0.5)
    assert time.monotonic() - began < 2.0
    assert 1 <= slow.injected["delay"] <= 2  # one block per 0.4 s, for 0.5 s


def test_a_promotion_is_not_abandoned_while_recomputing_would_take_longer(
    make: Callable[..., Harness],
) -> None:
    """`promotion.deadline` is 0.2 s, the tier takes 0.6 s, but recomputing the block would
    take 1 s (32 tokens at 32 tokens per second): the promotion is waited for, not late."""
    cfg = TierConfig(name="mem", type="memory", write="back")
    tier = StubbornMemoryTier(namespace=NAMESPACE, name="mem")  # each read takes 0.6 s
    h = make([(cfg, tier)], slots=4, reserve=1, promotion_deadline=0.2, prefill_rate=32.0)
    plant(tier, k(1), tier._encode(k(1), h.block(1))[1][0] + h.block(1))
    assert h.manager.lookup(k(1)) is PENDING
    h.manager.on_schedule_end()
    time.sleep(0.3)  # past `deadline`, not past the recompute estimate
    assert h.manager.lookup(k(1)) is PENDING
    h.manager.on_schedule_end()
    h.lookup_until(1, HIT)
    assert h.manager.counters["promotions_late"] == 0
    assert h.slot_bytes(1) == h.block(1)


@pytest.mark.parametrize("section", ["resident_off", "no_flush"])
def test_the_shutdown_section_turns_the_resident_flush_off(
    make: Callable[..., Harness], tmp_path: Any, section: str
) -> None:
    """`shutdown.resident: false` sends the write-back tier nothing at shutdown;
    `shutdown.flush: 0` writes nothing more at all, the write-through tier's queue included."""
    shutdown = (
        ShutdownConfig(resident=False) if section == "resident_off" else ShutdownConfig(flush=0.0)
    )
    cfg = TierConfig(name="nvme", type="file", write="back")
    through_cfg, through = memory_tier(name="mem", indexed=True)
    tier = file_tier(tmp_path)
    h = make([(cfg, tier), (through_cfg, through)], slots=8, reserve=1, shutdown=shutdown)
    h.store(*range(6))  # stored in the last step: the write-through queue still holds them
    h.manager.shutdown()
    assert not any(tier.knows(k(i)) for i in range(6))
    assert h.manager.stats()["tiers"]["nvme"]["demotions"] == 0
    written = h.manager.stats()["tiers"]["mem"]["demotions"]
    assert written == (6 if section == "resident_off" else 0)
