"""The background I/O runtime: one thread, one asyncio loop, in the scheduler process.

The scheduler thread never awaits: it `submit`s jobs (coroutine factories with a deadline and a
tier name) and, once per engine step, `poll`s the finished ones, or gives each job a `done`
handler that the runtime calls with its result on its own thread. Results are data
(`JobResult`), never exceptions thrown into the scheduler. A hook (`add_hook`) runs on the
runtime's thread at every tick (the tiering manager applies results and reclaims slots this way,
off the scheduler's calls; `nudge` wakes an idle runtime for it).

Every job passes its tier's circuit breakers (`tiering.breaker`: a tier's breaker, and a write
breaker for jobs that write); what a job's outcome counts for them is `fault_of`'s answer.

Hand-off costs the scheduler no system call while the runtime is busy: `submit` appends to an
inbox that the runtime looks at every `TICK` while it has work; only a runtime idle for
`IDLE_AFTER` is woken (waking a thread costs the waker a system call and a context switch:
too much for every step; BENCHMARKS.md, "The tiering manager on the shared trace").

The runtime refuses to be called from its own loop (a tier calling back into the scheduler's
API would deadlock), starts afresh in a forked child (threads do not survive `fork`), and shuts
down within a bound: in-flight jobs get `grace` seconds, then are cancelled and reported.
Circuit breakers live apart (`tiering.breaker`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from tiering.breaker import Breaker, fault_of
from tiering.config import BreakerConfig
from tiering.errors import CorruptObject, StateError, TierError, TierFull, TierTimeout

__all__ = ["Job", "JobResult", "Runtime"]

log = logging.getLogger(__name__)

TICK = 0.001
"""Seconds between the runtime's looks at its inbox while it has work."""
IDLE_AFTER = 0.05
"""Seconds without work after which the runtime waits to be woken instead of ticking."""


@dataclass(frozen=True, slots=True)
class Job:
    """A unit of tier I/O. Made on any thread, run on the runtime's thread."""

    tier: str
    """The tier the job talks to: its breaker decides, and records the outcome."""
    run: Callable[[], Awaitable[Any]]
    """Makes the coroutine, on the runtime's loop."""
    deadline: float
    """Seconds from submission; later, the job is cancelled and fails with `TierTimeout`."""
    tag: Any = None
    """Returned with the result, for the submitter's bookkeeping."""
    done: Callable[[JobResult], None] | None = None
    """Called with the result on the runtime's thread instead of queuing it for `poll` (the job
    counts as pending until it returns). It must not block; an exception is logged."""
    writes: bool = False
    """The job writes to the tier (a demotion): it passes the tier's write breaker too."""
    bulk: bool = False
    """A background bulk transfer (a warm start's batch): its length is its size's, not the
    tier's latency, so a breaker's `latency` does not count it (its faults do)."""


@dataclass(frozen=True, slots=True)
class JobResult:
    """A job's outcome, as data. Made on the runtime's thread, read on any."""

    job_id: int
    tier: str
    ok: bool
    value: Any = None
    error: BaseException | None = None
    seconds: float = 0.0
    tag: Any = None
    fault: BaseException | None = None
    """What the breakers counted against the tier (`tiering.breaker`): `error` for a job that
    raised, the first fault among a batch's items otherwise (`ok` is True then: the items carry
    their own outcomes); None for a success or a job refused by an open breaker."""


_Tickets = tuple[int, int | None]
"""A running job's tickets from its tier's breaker and, for a job that writes, its write
breaker."""


class Runtime:
    """The background I/O runtime. Scheduler process: its own thread runs the loop, the jobs
    and the hooks; submit from any thread but that one; poll from the scheduler thread."""

    def __init__(self, breaker: BreakerConfig | None = None, name: str = "kvtier-runtime") -> None:
        self.breaker_config = breaker or BreakerConfig()
        self.name = name
        self._lock = threading.Lock()
        self._results: collections.deque[JobResult] = collections.deque()
        self._breakers: dict[str, Breaker] = {}
        self._write_breakers: dict[str, Breaker] = {}
        self._next_id = 0
        self._pending: set[int] = set()  # submitted, not yet reported
        self._inbox: collections.deque[tuple[int, Job, _Tickets]] = collections.deque()
        self._sleeping = False  # the pump waits for a wake-up (it ticks otherwise)
        self._hooks: list[Callable[[], bool]] = []
        self._wake: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._closed = False
        at_fork_in_child(self, _forget_parent_thread)

    # -- lifecycle ------------------------------------------------------------------------------

    def _ensure_started(self) -> asyncio.AbstractEventLoop:
        if self._closed:
            raise StateError(f"runtime {self.name} is shut down")
        if self._pid != os.getpid():  # forked: the thread and loop stayed with the parent
            self._loop, self._thread, self._pid = None, None, os.getpid()
            self._pending.clear()
            self._inbox.clear()
            self._tasks.clear()
            self._sleeping = False
            self._lock = threading.Lock()
            for breaker in [*self._breakers.values(), *self._write_breakers.values()]:
                breaker.after_fork()
        if self._loop is None:
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def main() -> None:
                asyncio.set_event_loop(loop)
                self._wake = asyncio.Event()
                pump = loop.create_task(self._pump())
                loop.call_soon(ready.set)
                loop.run_forever()
                pump.cancel()

            # Both set before the thread starts: its hooks may submit (from the loop) at once.
            self._loop = loop
            self._thread = threading.Thread(target=main, name=self.name, daemon=True)
            self._thread.start()
            ready.wait()
        return self._loop

    def shutdown(self, grace: float = 2.0) -> None:
        """Let in-flight jobs finish for up to `grace` seconds, cancel the rest (reported as
        failed), stop the loop and join the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or self._pid != os.getpid():
            return
        deadline = time.monotonic() + grace
        while self.pending() and time.monotonic() < deadline:
            time.sleep(0.001)
        with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
            asyncio.run_coroutine_threadsafe(_cancel_all(), loop).result(timeout=1.0)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=grace + 1.0)
        if not thread.is_alive():
            loop.close()

    # -- jobs -----------------------------------------------------------------------------------

    def submit(self, job: Job) -> int:
        """Start `job` on the runtime; its id. Never blocks, never raises for a tier's sake: a
        job refused by an open breaker is reported at once as failed."""
        return self.submit_many([job])[0]

    def submit_many(self, jobs: list[Job]) -> list[int]:
        """`submit` for several jobs. A busy runtime picks them up at its next tick (at most
        `TICK` seconds later) with no system call here; an idle one is woken, once (waking a
        thread costs this thread a system call: too much for every step)."""
        self._refuse_reentry()
        return self._submit(jobs)

    def submit_from_loop(self, jobs: list[Job]) -> list[int]:
        """`submit_many` from a job or handler running on the runtime's own thread: the jobs
        start at once (a tier calling back into the scheduler's API must still use `submit`,
        which refuses)."""
        if self._thread is None or threading.current_thread() is not self._thread:
            raise StateError(f"runtime {self.name}: submit_from_loop called off its thread")
        return self._submit(jobs)

    def _submit(self, jobs: list[Job]) -> list[int]:
        loop = self._ensure_started()
        ids: list[int] = []
        runnable: list[tuple[int, Job, _Tickets]] = []
        with self._lock:
            first = self._next_id
            self._next_id += len(jobs)
        for job_id, job in enumerate(jobs, first):
            ids.append(job_id)
            tickets = self._admit(job)
            if isinstance(tickets, TierError):
                self._fail(job_id, job, tickets)
            else:
                runnable.append((job_id, job, tickets))
        if not runnable:
            return ids
        with self._lock:
            self._pending.update(job_id for job_id, _, _ in runnable)
        if threading.current_thread() is self._thread:  # on the loop: start them now
            self._start(loop, runnable)
            return ids
        self._inbox.extend(runnable)
        self._wake_if_sleeping(loop)  # read after the append: see `_pump`
        return ids

    def _wake_if_sleeping(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._sleeping:
            self._sleeping = False
            assert self._wake is not None
            loop.call_soon_threadsafe(self._wake.set)

    def _start(
        self, loop: asyncio.AbstractEventLoop, runnable: list[tuple[int, Job, _Tickets]]
    ) -> None:
        for entry in runnable:
            task = loop.create_task(self._run(*entry))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self) -> None:
        """Start the inbox's jobs; tick every `TICK` seconds while there is work (jobs in
        flight or submitted within `IDLE_AFTER`), wait for a wake-up otherwise."""
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        active_until = 0.0
        while True:
            if self._inbox:
                inbox = self._inbox
                self._start(loop, [inbox.popleft() for _ in range(len(inbox))])
                active_until = time.monotonic() + IDLE_AFTER
            if self._hooks and self._run_hooks():
                active_until = time.monotonic() + IDLE_AFTER
            elif not self._inbox and not self._tasks and time.monotonic() > active_until:
                # Say we sleep, then look again: a submitter appends (a hook's owner queues
                # its work) before it reads the flag, so either we see it here or it sees the
                # flag and wakes us.
                self._wake.clear()
                self._sleeping = True
                if not self._inbox and not (self._hooks and self._run_hooks()):
                    await self._wake.wait()
                self._sleeping = False
                continue
            await asyncio.sleep(TICK)

    def add_hook(self, hook: Callable[[], bool]) -> None:
        """Call `hook` on the runtime's thread at every tick; it returns whether it did or has
        work (the runtime keeps ticking while it does, and for `IDLE_AFTER` after). It must not
        block; an exception is logged."""
        self._hooks = [*self._hooks, hook]  # a new list: the loop iterates the old one

    def remove_hook(self, hook: Callable[[], bool]) -> None:
        """Stop calling `hook` (from any thread; a tick under way may still call it once)."""
        self._hooks = [h for h in self._hooks if h != hook]  # (bound methods: equal, not same)

    def nudge(self) -> None:
        """Make sure the hooks run within a tick: start the runtime or wake it if it is idle (a
        busy one ticks anyway: this costs a few attribute reads then)."""
        if self._sleeping or self._loop is None or self._pid < 0:
            self._wake_if_sleeping(self._ensure_started())

    def _run_hooks(self) -> bool:
        busy = False
        for hook in self._hooks:
            try:
                busy = hook() or busy
            except Exception:  # a hook's bug must not stop the runtime
                log.exception("runtime %s: a hook failed", self.name)
        return busy

    def poll(self) -> list[JobResult]:
        """Results finished since the last poll, oldest first. Never blocks."""
        with self._lock:
            results = list(self._results)
            self._results.clear()
        return results

    def pending(self) -> int:
        return len(self._pending)

    def pending_ids(self) -> set[int]:
        """The ids of the jobs submitted and not yet reported (a copy)."""
        with self._lock:
            return set(self._pending)

    def run_sync(self, factory: Callable[[], Awaitable[Any]], timeout: float) -> Any:
        """Run a coroutine on the runtime and wait for it (set-up and tear-down only: never on
        the scheduler's step path)."""
        self._refuse_reentry()
        loop = self._ensure_started()
        future = asyncio.run_coroutine_threadsafe(_call(factory), loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError as e:
            future.cancel()
            raise TierTimeout(f"runtime call did not finish within {timeout:g}s") from e

    def breaker_state(self, tier: str) -> str:
        """The state of `tier`'s breaker (the one every job of the tier passes)."""
        return self._breaker(tier).state

    def breaker(self, tier: str) -> Breaker:
        return self._breaker(tier)

    def write_breaker(self, tier: str) -> Breaker:
        """`tier`'s write breaker (jobs with `writes` pass it too)."""
        return self._write_breaker(tier)

    # -- inside -----------------------------------------------------------------------------------

    def _breaker(self, tier: str) -> Breaker:
        breaker = self._breakers.get(tier)
        if breaker is None:  # setdefault: two threads may get here at once
            breaker = self._breakers.setdefault(
                tier, Breaker(f"tier {tier!r}", self.breaker_config)
            )
        return breaker

    def _write_breaker(self, tier: str) -> Breaker:
        breaker = self._write_breakers.get(tier)
        if breaker is None:
            breaker = self._write_breakers.setdefault(
                tier, Breaker(f"writes to tier {tier!r}", self.breaker_config)
            )
        return breaker

    def _admit(self, job: Job) -> _Tickets | TierError:
        """The job's tickets from the breakers it passes, or the error of its refusal. The
        write breaker is asked first: a write refused there leaves a half-open tier breaker's
        probe to the next job."""
        write_ticket = None
        if job.writes:
            write_ticket = self._write_breaker(job.tier).admit()
            if write_ticket is None:
                return self._write_breaker(job.tier).refusal()
        breaker = self._breaker(job.tier)
        ticket = breaker.admit()
        if ticket is None:
            if write_ticket is not None:
                self._write_breaker(job.tier).cancel(write_ticket)
            return breaker.refusal()
        return ticket, write_ticket

    def _account(
        self, job: Job, tickets: _Tickets, fault: BaseException | None, seconds: float
    ) -> None:
        """Record a job's outcome with its breakers (module docstring: `TierFull` counts only
        against writes)."""
        ticket, write_ticket = tickets
        if job.bulk:
            seconds = 0.0
        self._breaker(job.tier).record(
            ticket, fault is None or isinstance(fault, TierFull), seconds, fault
        )
        if write_ticket is not None:
            self._write_breaker(job.tier).record(write_ticket, fault is None, seconds, fault)

    def on_loop_thread(self) -> bool:
        """Whether the caller runs on the runtime's own thread (its jobs, handlers and hooks)."""
        return self._thread is not None and threading.current_thread() is self._thread

    def _refuse_reentry(self) -> None:
        if self.on_loop_thread():
            raise StateError(
                f"runtime {self.name}: called from its own loop (a tier called back into the "
                "scheduler's API); that would deadlock"
            )

    async def _run(self, job_id: int, job: Job, tickets: _Tickets) -> None:
        start = time.monotonic()
        try:
            async with asyncio.timeout(job.deadline):
                value = await job.run()
        except asyncio.CancelledError:  # shutdown
            self._fail(job_id, job, TierTimeout(f"tier {job.tier!r}: job cancelled at shutdown"))
            raise
        except Exception as e:  # a tier's failure is data for the submitter
            seconds = time.monotonic() - start
            if isinstance(e, TimeoutError) and not isinstance(e, TierError):
                e = TierTimeout(f"tier {job.tier!r}: job passed its {job.deadline:g}s deadline")
            fault: BaseException | None = None if isinstance(e, CorruptObject) else e
            self._account(job, tickets, fault, seconds)
            self._fail(job_id, job, e, seconds, fault)
            return
        seconds = time.monotonic() - start
        fault = fault_of(value)
        self._account(job, tickets, fault, seconds)
        self._report(
            JobResult(
                job_id, job.tier, True, value=value, seconds=seconds, tag=job.tag, fault=fault
            ),
            job.done,
        )

    def _fail(
        self,
        job_id: int,
        job: Job,
        error: BaseException,
        seconds: float = 0.0,
        fault: BaseException | None = None,
    ) -> None:
        result = JobResult(
            job_id, job.tier, False, error=error, seconds=seconds, tag=job.tag, fault=fault
        )
        self._report(result, job.done)

    def _report(self, result: JobResult, done: Callable[[JobResult], None] | None) -> None:
        if done is None:
            with self._lock:
                self._results.append(result)
                self._pending.discard(result.job_id)
            return
        try:
            done(result)
        except Exception:  # a handler's bug must not stop the runtime
            log.exception("runtime %s: the handler of job %d failed", self.name, result.job_id)
        with self._lock:
            self._pending.discard(result.job_id)


async def _cancel_all() -> None:
    current = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not current]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


_Owner = TypeVar("_Owner")


def at_fork_in_child(owner: _Owner, reset: Callable[[_Owner], None]) -> None:
    """Call `reset(owner)` in a forked child while `owner` lives: threads (and any lock they
    held) stay with the parent."""
    ref = weakref.ref(owner)

    def after_in_child() -> None:
        child = ref()
        if child is not None:
            reset(child)

    os.register_at_fork(after_in_child=after_in_child)


def _forget_parent_thread(runtime: Runtime) -> None:
    runtime._pid = -1  # the next use (a `nudge` too) starts a thread and loop afresh


async def _call(factory: Callable[[], Awaitable[Any]]) -> Any:
    return await factory()
