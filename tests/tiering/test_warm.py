"""The warm start alone (`tiering.manager.warm.WarmStart`): its plan, its batches, and what a
batch's result does, over a real primary pool, memory tiers and promoter, with no runtime (the
jobs are read from the sink and answered by hand)."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

import pytest

from tiering.config import TierConfig
from tiering.errors import TierTimeout, TierUnavailable
from tiering.keys import BlockKey, make_key
from tiering.manager.jobs import JobSink, Promotion
from tiering.manager.locator import TierLocator
from tiering.manager.promotion import Promoter
from tiering.manager.tierstate import TierState
from tiering.manager.warm import WarmStart
from tiering.placement import BlockHistory
from tiering.placement.gates import AlwaysGate
from tiering.primary import KeyState, LookupResult, PrimaryPool
from tiering.runtime import Job, JobResult
from tiering.testing import NAMESPACE
from tiers.memory import MemoryTier

BLOCK = 64


def k(i: int) -> BlockKey:
    return make_key(i.to_bytes(32, "big"))


class Parts:
    """A primary of `slots` slots and memory tiers holding the given ids (the last written the
    newest), with the promoter a warm start submits through."""

    def __init__(self, slots: int, *held: list[int]) -> None:
        self.pool = PrimaryPool(slots)
        self.memory = bytearray(slots * BLOCK)
        self.tiers = []
        for index, ids in enumerate(held):
            tier = MemoryTier(namespace=NAMESPACE, name=f"t{index}")
            for i in ids:
                asyncio.run(tier.put(k(i), bytes([i]) * BLOCK))
            self.tiers.append(
                TierState.of(TierConfig(name=f"t{index}", type="memory"), tier, index)
            )
        self.counters: defaultdict[str, float] = defaultdict(float)
        self.sink = JobSink(lambda result: None)
        locator = TierLocator(self.tiers, self.sink, 1.0)
        self.promoter = Promoter(
            self.pool,
            self.tiers,
            locator,
            BlockHistory(tracks_hits=False, tracks_age=False),
            AlwaysGate(block_tokens=16, prefill_rate=1000.0),
            self.sink,
            slot_view=self.view,
            deadline=1.0,
            counters=self.counters,
            clock=lambda: 0.0,
            write_back=False,
        )

    def view(self, slot: int) -> memoryview:
        return memoryview(self.memory)[slot * BLOCK : (slot + 1) * BLOCK]

    def warm(self, budget: int, reserve: int = 0) -> WarmStart:
        return WarmStart(
            self.pool,
            self.tiers,
            self.promoter,
            self.counters,
            budget=budget,
            block_bytes=BLOCK,
            reserve=reserve,
        )

    def batch(self) -> tuple[Job, Promotion]:
        """The one job the last submission made."""
        (job,) = self.sink.take()
        assert isinstance(job.tag, Promotion)
        return job, job.tag

    def answer(
        self, warm: WarmStart, job: Promotion, value: Any, *, ok: bool = True, fault: Any = None
    ) -> None:
        """The batch's result, applied as the bookkeeping applies it."""
        result = JobResult(0, "t", ok, value=value, tag=job, fault=fault)
        state = self.tiers[job.tier]
        found = self.promoter.promoted(state, job, result)
        warm.promoted(state, job, result, found)


def keys_of(job: Promotion) -> list[BlockKey]:
    return [key for key, _ in job.batch]


def test_the_plan_is_the_newest_blocks_each_from_the_first_tier_that_has_it() -> None:
    parts = Parts(16, [1, 2, 3], [3, 4, 5])
    warm = parts.warm(budget=5)
    assert warm.budget == 5 and warm.due()
    warm.submit()
    job, tag = parts.batch()
    assert job.bulk and tag.bulk and tag.tier == 0
    assert keys_of(tag) == [k(3), k(2), k(1)]  # one tier per batch, the newest first
    assert warm.warming and warm.keys == {k(1), k(2), k(3)} and not warm.due()
    assert set(parts.promoter.promoting) == {k(1), k(2), k(3)}
    parts.answer(warm, tag, asyncio.run(job.run()))  # read into the slots
    assert not warm.warming and parts.counters["blocks_warmed"] == 3
    warm.submit()
    job, tag = parts.batch()
    assert tag.tier == 1 and keys_of(tag) == [k(5), k(4)]  # k(3) came from the first tier
    parts.answer(warm, tag, asyncio.run(job.run()))
    assert warm.budget == 0 and not warm.due()
    assert all(parts.pool.state(k(i)) is KeyState.READY for i in range(1, 6))
    assert bytes(parts.view(parts.pool.slot(k(4)))) == bytes([4]) * BLOCK


def test_a_budget_of_zero_plans_nothing_and_the_budget_is_at_most_the_primary() -> None:
    parts = Parts(4, list(range(10)))
    assert parts.warm(budget=0).budget == 0
    assert not parts.warm(budget=0).due()
    assert parts.warm(budget=100).budget == 4


def test_a_batch_takes_only_free_slots_above_the_reserve_and_ends_without_room() -> None:
    parts = Parts(8, list(range(10)))
    warm = parts.warm(budget=8, reserve=6)
    warm.submit()
    _, tag = parts.batch()
    assert len(tag.batch) == 2  # a quarter of the primary, and the 2 slots above the reserve
    parts.answer(warm, tag, [True, True])
    warm.submit()  # no free slot above the reserve is left
    assert parts.sink.take() == [] and warm.budget == 0 and not warm.due()


def test_blocks_resident_or_promoted_meanwhile_are_skipped() -> None:
    parts = Parts(16, [1, 2, 3])
    warm = parts.warm(budget=3)
    grant = parts.pool.prepare_store([k(3)])
    assert grant is not None
    parts.pool.complete_store([k(3)])
    assert parts.promoter.request(k(2), parts.tiers[0]) is LookupResult.PENDING
    warm.submit()
    _, tag = parts.batch()
    assert keys_of(tag) == [k(1)]


def test_a_lookup_of_a_block_in_flight_makes_the_engine_wait_on_it() -> None:
    parts = Parts(16, [1, 2])
    warm = parts.warm(budget=2)
    warm.submit()
    parts.batch()
    assert warm.unasked()
    warm.ask(k(9))  # not the batch's
    assert warm.unasked()
    warm.ask(k(2))
    assert not warm.unasked() and warm.keys == {k(1)}
    warm.late([k(1)])
    assert warm.keys == set()


def test_a_batch_that_fails_as_a_whole_ends_the_warm_start() -> None:
    parts = Parts(16, [1, 2, 3, 4])
    warm = parts.warm(budget=4)
    warm.submit()
    _, tag = parts.batch()
    parts.answer(warm, tag, None, ok=False, fault=TierUnavailable("down"))
    assert parts.counters["warm_stopped"] == 1 and warm.budget == 0 and not warm.due()
    assert parts.pool.num_free == 16  # the batch's slots were freed


def test_a_block_that_failed_alone_is_read_once_more() -> None:
    parts = Parts(16, [1, 2])
    warm = parts.warm(budget=2)
    warm.submit()
    _, tag = parts.batch()
    first, second = keys_of(tag)
    parts.answer(warm, tag, [True, TierTimeout("slow")])
    assert parts.counters["warm_retries"] == 1 and warm.budget == 1 and warm.due()
    warm.submit()
    _, again = parts.batch()
    assert keys_of(again) == [second]
    parts.answer(warm, again, [TierTimeout("slow")])  # a second failure is not retried
    assert parts.counters["warm_retries"] == 1 and warm.budget == 0
    assert parts.pool.state(first) is KeyState.READY and second not in parts.pool


@pytest.mark.parametrize("why", ["reset", "shutdown"])
def test_an_ended_warm_start_submits_nothing_more_and_clear_forgets_the_batch(why: str) -> None:
    parts = Parts(16, [1, 2, 3])
    warm = parts.warm(budget=3)
    warm.submit()
    parts.batch()
    warm.end(why)
    assert warm.warming and not warm.due()  # the batch in flight still ends as it would
    warm.clear()
    assert not warm.warming and warm.keys == set()
    warm.submit()
    assert parts.sink.take() == []
