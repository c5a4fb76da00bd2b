"""The background I/O runtime: jobs, deadlines, breakers, re-entry, fork and shutdown."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from tiering.breaker import Breaker
from tiering.config import BreakerConfig
from tiering.errors import StateError, TierTimeout, TierUnavailable
from tiering.runtime import Job, JobResult, Runtime


def wait_for(runtime: Runtime, n: int, timeout: float = 5.0) -> list[JobResult]:
    results: list[JobResult] = []
    deadline = time.monotonic() + timeout
    while len(results) < n and time.monotonic() < deadline:
        results += runtime.poll()
        time.sleep(0.005)
    return results


async def value(x: object, delay: float = 0.0) -> object:
    await asyncio.sleep(delay)
    return x


async def fail(error: Exception) -> None:
    raise error


@pytest.fixture
def runtime() -> Runtime:
    rt = Runtime(BreakerConfig(failures=3, cooldown=0.2))
    yield rt  # type: ignore[misc]
    rt.shutdown()


def test_submit_and_poll(runtime: Runtime) -> None:
    ids = [
        runtime.submit(Job("t", lambda i=i: value(i, 0.01 * (3 - i)), 1.0, tag=f"tag{i}"))
        for i in range(3)
    ]
    results = {r.job_id: r for r in wait_for(runtime, 3)}
    assert sorted(results) == ids
    for i, job_id in enumerate(ids):
        assert (
            results[job_id].ok and results[job_id].value == i and results[job_id].tag == f"tag{i}"
        )
    assert runtime.poll() == []


def test_deadline_becomes_tier_timeout(runtime: Runtime) -> None:
    start = time.monotonic()
    runtime.submit(Job("slow", lambda: value(1, 10.0), 0.1))
    (result,) = wait_for(runtime, 1)
    assert not result.ok and isinstance(result.error, TierTimeout)
    assert time.monotonic() - start < 1.0


def test_failures_are_data(runtime: Runtime) -> None:
    runtime.submit(Job("t", lambda: fail(TierUnavailable("down")), 1.0))
    runtime.submit(Job("t", lambda: fail(ValueError("bug in a tier")), 1.0))
    results = wait_for(runtime, 2)
    assert [type(r.error) for r in results] == [TierUnavailable, ValueError]


def test_breaker_opens_refuses_then_probes(runtime: Runtime) -> None:
    for _ in range(3):
        runtime.submit(Job("redis", lambda: fail(TierUnavailable("down")), 1.0))
    wait_for(runtime, 3)
    assert runtime.breaker_state("redis") == "open"
    start = time.monotonic()
    runtime.submit(Job("redis", lambda: value(1), 1.0))
    (refused,) = wait_for(runtime, 1)
    assert not refused.ok and "circuit breaker open" in str(refused.error)
    assert time.monotonic() - start < 0.1
    runtime.submit(Job("other", lambda: value(2), 1.0))  # other tiers are not affected
    assert wait_for(runtime, 1)[0].ok
    time.sleep(0.25)  # cooldown: one probe goes through and closes the breaker
    runtime.submit(Job("redis", lambda: value(3), 1.0))
    assert wait_for(runtime, 1)[0].ok
    assert runtime.breaker_state("redis") == "closed"


def test_breaker_counts_slow_calls_and_failed_probes() -> None:
    now = [0.0]
    breaker = Breaker(
        "t", BreakerConfig(failures=2, cooldown=5.0, latency=0.1), clock=lambda: now[0]
    )
    ticket = breaker.admit()
    assert ticket is not None
    breaker.record(ticket, True, 0.5)  # slow
    breaker.record(ticket, True, 0.01)  # fast: resets
    breaker.record(ticket, True, 0.5)
    breaker.record(ticket, False, 0.01)
    assert breaker.state == "open" and breaker.admit() is None
    now[0] = 6.0
    probe = breaker.admit()
    assert probe is not None and breaker.admit() is None  # one probe only
    breaker.record(ticket, True, 0.01)  # a job from before it opened: changes nothing
    assert breaker.state == "half-open"
    breaker.record(probe, False, 0.01)
    assert breaker.state == "open" and breaker.opened == 2 and breaker.refused == 2


def test_reentry_from_the_loop_is_refused(runtime: Runtime) -> None:
    async def reenter() -> None:
        runtime.submit(Job("t", lambda: value(1), 1.0))

    runtime.submit(Job("t", reenter, 1.0))
    (result,) = wait_for(runtime, 1)
    assert isinstance(result.error, StateError) and "own loop" in str(result.error)


def test_survives_fork(runtime: Runtime) -> None:
    runtime.submit(Job("t", lambda: value(1), 1.0))
    wait_for(runtime, 1)
    pid = os.fork()
    if pid == 0:  # the child: a fresh thread and loop
        try:
            runtime.submit(Job("t", lambda: value(7), 1.0))
            results = wait_for(runtime, 1)
            os._exit(0 if results and results[0].value == 7 else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    runtime.submit(Job("t", lambda: value(8), 1.0))  # the parent's runtime still works
    assert wait_for(runtime, 1)[0].value == 8


def test_shutdown_is_bounded_and_reports_cancelled_jobs() -> None:
    runtime = Runtime()
    runtime.submit(Job("t", lambda: value(1, 30.0), 60.0))
    runtime.submit(Job("t", lambda: value(2, 0.01), 60.0))
    time.sleep(0.1)
    start = time.monotonic()
    runtime.shutdown(grace=0.2)
    assert time.monotonic() - start < 2.0
    results = runtime.poll()
    assert any(r.ok and r.value == 2 for r in results)
    assert any(not r.ok and "cancelled" in str(r.error) for r in results)
    with pytest.raises(StateError, match="shut down"):
        runtime.submit(Job("t", lambda: value(1), 1.0))


def test_run_sync(runtime: Runtime) -> None:
    assert runtime.run_sync(lambda: value(5), 1.0) == 5
    with pytest.raises(TierTimeout):
        runtime.run_sync(lambda: value(5, 5.0), 0.1)


def test_a_busy_runtime_takes_jobs_without_a_wake_up_and_an_idle_one_is_woken(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tiering.runtime as module

    monkeypatch.setattr(module, "IDLE_AFTER", 0.3)
    runtime.submit(Job("t", lambda: value(1), 1.0))
    assert len(wait_for(runtime, 1)) == 1
    loop = runtime._loop
    assert loop is not None
    wakes: list[object] = []
    real = loop.call_soon_threadsafe

    def counting(*args: object) -> object:
        wakes.append(args)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(loop, "call_soon_threadsafe", counting)
    runtime.submit(Job("t", lambda: value(2), 1.0))  # within IDLE_AFTER: still ticking
    assert [r.value for r in wait_for(runtime, 1)] == [2]
    assert wakes == []
    time.sleep(0.5)  # idle: the runtime waits to be woken
    start = time.monotonic()
    runtime.submit(Job("t", lambda: value(3), 1.0))
    assert [r.value for r in wait_for(runtime, 1)] == [3]
    assert len(wakes) == 1 and time.monotonic() - start < 1.0


def test_done_handlers_run_on_the_runtime_thread_and_count_as_pending(runtime: Runtime) -> None:
    import threading

    seen: list[tuple[object, str]] = []

    def done(result: JobResult) -> None:
        time.sleep(0.05)  # still pending meanwhile
        seen.append((result.value, threading.current_thread().name))

    runtime.submit(Job("t", lambda: value(3), 1.0, done=done))
    time.sleep(0.02)
    assert runtime.pending() == 1
    deadline = time.monotonic() + 5
    while runtime.pending() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert seen == [(3, runtime.name)] and runtime.poll() == []  # handled, not queued


def test_hooks_run_every_tick_and_a_nudge_wakes_an_idle_runtime(runtime: Runtime) -> None:
    work: list[int] = []
    done: list[int] = []

    def hook() -> bool:
        if work:
            done.append(work.pop())
            return True
        return False

    runtime.add_hook(hook)
    runtime.nudge()  # starts it
    time.sleep(0.2)  # idle for longer than IDLE_AFTER: asleep
    work.append(1)
    runtime.nudge()
    deadline = time.monotonic() + 2
    while not done and time.monotonic() < deadline:
        time.sleep(0.001)
    assert done == [1]


def test_hooks_run_in_a_forked_child(runtime: Runtime) -> None:
    work: list[int] = []
    done: list[int] = []

    def hook() -> bool:
        if work:
            done.append(work.pop())
        return False

    runtime.add_hook(hook)
    runtime.submit(Job("t", lambda: value(1, 0.5), 2.0))  # in flight: the runtime is ticking
    time.sleep(0.02)
    pid = os.fork()
    if pid == 0:  # the child: the parent's thread is gone; a nudge starts a new one
        try:
            work.append(7)
            runtime.nudge()
            deadline = time.monotonic() + 2
            while not done and time.monotonic() < deadline:
                time.sleep(0.001)
            os._exit(0 if done == [7] else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
