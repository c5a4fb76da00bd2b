"""The manager's pieces alone: the step lock, the tier locator, the job records, and the step
driver."""

from __future__ import annotations

import logging
import threading

import pytest

from tiering.config import TierConfig
from tiering.keys import BlockKey, make_key
from tiering.manager.jobs import (
    Demotion,
    ExistenceCheck,
    JobSink,
    Promotion,
    SlotHold,
    TierJob,
    answers,
)
from tiering.manager.locator import ABSENT, NEGATIVE_TTL, POSITIVE_TTL, TierLocator
from tiering.manager.steplock import STEP_WARN_AFTER, StepLock
from tiering.manager.tierstate import TierState
from tiering.primary import LookupResult, PrimaryPool, StoreGrant
from tiering.runtime import JobResult
from tiering.stepping import Scan, StepDriver
from tiering.testing import NAMESPACE
from tiers.memory import MemoryTier


def k(i: int) -> BlockKey:
    return make_key(i.to_bytes(32, "big"))


class TestStepLock:
    def test_a_step_holds_the_lock_from_begin_to_end(self) -> None:
        lock = StepLock()
        lock.begin()
        assert lock.stepping and lock.owned()
        other: list[bool] = []
        thread = threading.Thread(target=lambda: other.append(lock.try_acquire()))
        thread.start()
        thread.join()
        assert other == [False]  # the runtime's try fails while the step lasts
        assert lock.call(lambda: lock.owned())  # inside the step: no second acquisition
        lock.end()
        assert not lock.stepping and not lock.owned()
        lock.end()  # outside a step: nothing

    def test_calls_outside_a_step_take_the_lock_one_at_a_time(self) -> None:
        lock = StepLock()
        assert lock.call(lock.owned) and not lock.owned()
        with lock.held():
            assert lock.owned()
        assert not lock.owned()

    def test_a_step_inside_a_step_and_a_release_by_a_stranger_are_bugs(self) -> None:
        lock = StepLock()
        lock.begin()
        with pytest.raises(AssertionError, match="inside a step"):
            lock.begin()
        lock.end()
        assert lock.try_acquire()
        errors: list[BaseException] = []

        def stranger() -> None:
            try:
                lock.release()
            except AssertionError as e:
                errors.append(e)

        thread = threading.Thread(target=stranger)
        thread.start()
        thread.join()
        assert errors and lock.owned()
        lock.release()

    def test_a_step_never_ended_is_said_once(self, caplog: pytest.LogCaptureFixture) -> None:
        now = [0.0]
        lock = StepLock(clock=lambda: now[0])
        lock.begin()
        caplog.set_level(logging.WARNING, logger="tiering.manager.steplock")
        tries: list[bool] = []

        def runtime() -> None:
            tries.append(lock.try_acquire())

        for at in (1.0, STEP_WARN_AFTER + 1, STEP_WARN_AFTER + 2):
            now[0] = at
            thread = threading.Thread(target=runtime)
            thread.start()
            thread.join()
        assert tries == [False, False, False]
        (record,) = caplog.records
        assert "without on_schedule_end" in record.getMessage()
        lock.end()

    def test_the_runtimes_thread_never_waits_for_it(self) -> None:
        runtime_thread: list[threading.Thread] = []
        lock = StepLock(forbidden=lambda: threading.current_thread() in runtime_thread)
        errors: list[str] = []

        def runtime() -> None:
            runtime_thread.append(threading.current_thread())
            for attempt in (lock.begin, lock.acquire):
                try:
                    attempt()  # would wait for the step: a deadlock, refused
                except AssertionError as e:
                    errors.append(str(e))
            assert not lock.try_acquire()  # its one way in

        lock.acquire()  # held by the scheduler (a call between steps)
        thread = threading.Thread(target=runtime)
        thread.start()
        thread.join()
        lock.release()
        assert errors == ["a wait for the step lock on a thread that must never wait for it"] * 2

    def test_a_forked_child_gets_a_free_lock(self) -> None:
        lock = StepLock()
        lock.begin()
        lock._reset()  # what the at-fork handler runs in the child
        assert not lock.stepping and lock.try_acquire()
        lock.release()


def tier_states(*indexed: bool) -> list[TierState]:
    return [
        TierState.of(
            TierConfig(name=f"t{i}", type="memory"),
            MemoryTier(namespace=NAMESPACE, name=f"t{i}"),
            i,
        )
        for i, _ in enumerate(indexed)
    ]


class TestTierLocator:
    def test_a_key_goes_to_the_first_tier_that_has_it_once_all_answered(self) -> None:
        states = tier_states(False, False)
        for state in states:
            state.indexed = False
        sink = JobSink(lambda result: None)
        locator = TierLocator(states, sink, 1.0)
        locator.queue_check(k(1))
        locator.queue_check(k(1))  # once
        locator.submit_checks()
        outbox = sink.take()
        assert len(outbox) == 2 and locator.to_check == []
        assert [job.tag for job in outbox] == [
            ExistenceCheck(0, 0, [k(1)]),
            ExistenceCheck(0, 1, [k(1)]),
        ]
        locator.answered(states[1], [k(1)], [True], now=10.0)
        assert k(1) not in locator.known  # the first tier has not answered
        locator.answered(states[0], [k(1)], [True], now=10.0)
        assert locator.known[k(1)] == (0, 10.0 + POSITIVE_TTL)
        assert locator.where(k(1)) is states[0]
        assert locator.holds(states[0], k(1), now=11.0)
        assert not locator.holds(states[0], k(1), now=10.0 + POSITIVE_TTL)
        assert states[0].counters["found"] == 1 and states[1].counters["found"] == 1

    def test_a_block_found_nowhere_is_absent_for_a_while(self) -> None:
        (state,) = tier_states(False)
        state.indexed = False
        locator = TierLocator([state], JobSink(print), 1.0)
        locator.queue_check(k(2))
        locator.submit_checks()
        locator.answered(state, [k(2)], [False], now=5.0)
        assert locator.known[k(2)] == (ABSENT, 5.0 + NEGATIVE_TTL)
        assert locator.where(k(2)) is None and state.counters["not_found"] == 1
        locator.found_in([k(2)], 0, now=6.0)
        assert locator.where(k(2)) is state
        locator.clear()
        assert not locator.known and not locator.checking


class TestJobRecords:
    def test_records_are_frozen_and_dispatch_by_type(self) -> None:
        jobs: list[TierJob] = [
            ExistenceCheck(1, 0, [k(1)]),
            Promotion(1, 0, [(k(1), 3)]),
            Demotion(1, 0, [k(1)], [], SlotHold.COPY),
        ]
        kinds = []
        for job in jobs:
            match job:
                case ExistenceCheck():
                    kinds.append("check")
                case Promotion():
                    kinds.append("promotion")
                case Demotion(hold=SlotHold.COPY):
                    kinds.append("copy")
        assert kinds == ["check", "promotion", "copy"]
        with pytest.raises(AttributeError):
            jobs[0].generation = 2  # type: ignore[misc]

    def test_a_wrong_number_of_answers_fails_every_item(self) -> None:
        ok = JobResult(0, "t", True, value=[True, False])
        assert answers(ok, 2, None) == [True, False]
        assert answers(ok, 3, None) == [None] * 3
        assert answers(JobResult(0, "t", False), 2, "x") == ["x", "x"]


class TestStepDriver:
    """The driver over the primary pool alone (it serves the same step protocol)."""

    class Pool(PrimaryPool):
        def on_schedule_end(self) -> None:
            self.steps = getattr(self, "steps", 0) + 1

        def has_pending_work(self) -> bool:
            return False

    def test_a_request_is_scanned_served_and_timed_as_vllm_does(self) -> None:
        pool = self.Pool(4, "lru")
        filled: dict[BlockKey, int] = {}
        driver = StepDriver(pool, fill=lambda key, slot: filled.__setitem__(key, slot))
        assert driver.store([k(1), k(2)]) is not None and set(filled) == {k(1), k(2)}
        scan = driver.admit([k(1), k(2), k(3), k(4)], max_scans=4)
        assert (scan.hits, scan.deferred, scan.settled) == (2, False, True)
        grant = driver.serve([k(1), k(2), k(3), k(4)], scan.hits)
        assert isinstance(grant, StoreGrant) and grant.keys == (k(3), k(4))
        assert pool.ref_count(k(1)) == 0  # the load completed
        driver.step()
        assert pool.steps == 1
        assert driver.blocks["lookup"] == 3 and driver.blocks["prepare_store"] == 4
        assert driver.spent > 0 and driver.slowest > 0

    def test_a_deferred_request_is_scanned_again_after_a_step(self) -> None:
        pool = self.Pool(4, "lru")
        driver = StepDriver(pool)
        pool.prepare_store([k(2)])  # being written: PENDING
        steps: list[int] = []
        scan = driver.admit([k(2), k(1)], max_scans=3, between=lambda: steps.append(1))
        assert scan == Scan(0, True, frozenset({k(2)}), settled=False)
        assert len(steps) == 3
        assert driver.lookup_until(k(2), (LookupResult.HIT,), steps=2, between=lambda: None) == [
            LookupResult.PENDING,
            LookupResult.PENDING,
        ]
