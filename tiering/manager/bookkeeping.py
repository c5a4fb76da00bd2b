"""The manager's runtime-side bookkeeping: finished jobs applied, between-step work, the tick.

Every job's result reaches `Arrivals` on the runtime's thread, without the lock; `Bookkeeping`
applies them under the step lock (`drain`: promoted blocks become ready, demoted blocks' slots
are given back, existence checks locate their keys) at the runtime's next tick (`on_tick`) or,
when the runtime missed a whole window between two steps, at the next step's end (`step_end`).
Between steps it submits the existence checks and promotions the step queued (allocating their
slots), pins write-through blocks and reclaims slots for write-back demotions (`between`), and
submits the warm start's batches. The runtime never waits for the lock: it tries, and tries
again a tick later.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from collections.abc import Sequence

from tiering import gil
from tiering.manager.counters import (
    BOOKKEEPING_CPU_SECONDS,
    BOOKKEEPING_ON_SCHEDULER,
    BOOKKEEPING_SECONDS,
    ERRORS,
    IDLE_WAITS,
)
from tiering.manager.demotion import Demoter
from tiering.manager.fences import ResetFences
from tiering.manager.jobs import Demotion, ExistenceCheck, JobSink, Promotion, TierJob, answers
from tiering.manager.locator import TierLocator
from tiering.manager.promotion import Promoter
from tiering.manager.steplock import StepLock
from tiering.manager.tierstate import TierState
from tiering.manager.warm import WarmStart
from tiering.placement import BlockHistory
from tiering.runtime import Job, JobResult, Runtime

__all__ = ["Arrivals", "Bookkeeping"]


class Arrivals:
    """The finished jobs not applied yet, and the engine's steps ended so far. Scheduler
    process: `arrived` on the runtime's thread (or the submitter's, for a job an open breaker
    refused) without the lock; the rest under it."""

    __slots__ = ("queue", "since", "step")

    def __init__(self) -> None:
        self.queue: deque[JobResult] = deque()
        self.step = 0
        """`on_schedule_end` calls so far."""
        self.since = 0
        """`step` when the oldest of `queue` arrived."""

    def arrived(self, result: JobResult) -> None:
        """Every job's `done` handler (`JobSink.done`)."""
        if not self.queue:
            self.since = self.step
        self.queue.append(result)


class Bookkeeping:
    """Applies finished jobs and does the between-step work. Scheduler process: `on_tick` on the
    runtime's thread, `step_end` on the scheduler's, the rest under the step lock."""

    __slots__ = (
        "arrivals",
        "clock",
        "closed",
        "counters",
        "demoter",
        "fences",
        "history",
        "locator",
        "lock",
        "progress",
        "promoter",
        "runtime",
        "sink",
        "ticking",
        "tiers",
        "urgency",
        "warm",
        "work_queued",
        "write_back",
    )

    def __init__(
        self,
        tiers: Sequence[TierState],
        sink: JobSink,
        arrivals: Arrivals,
        *,
        locator: TierLocator,
        promoter: Promoter,
        demoter: Demoter,
        warm: WarmStart,
        fences: ResetFences,
        history: BlockHistory,
        runtime: Runtime,
        lock: StepLock,
        counters: defaultdict[str, float],
    ) -> None:
        self.tiers = list(tiers)
        self.sink = sink
        self.arrivals = arrivals
        self.locator = locator
        self.promoter = promoter
        self.demoter = demoter
        self.warm = warm
        self.fences = fences
        self.history = history
        self.runtime = runtime
        self.lock = lock
        self.counters = counters
        self.clock = promoter.clock
        self.write_back = bool(demoter.write_back)
        self.work_queued = False
        """Between-step work handed to the runtime, not yet done."""
        self.ticking = False
        """The runtime's hook is at work (pending work, for `has_pending_work`)."""
        self.closed = False
        """Shut down: the runtime's last ticks claim no urgency."""
        self.urgency = gil.Urgency()
        """Claimed while promotions or existence checks are in flight (`tiering.gil`): a
        request waits on them while the engine's loop spins."""
        self.progress = threading.Event()
        """Set whenever finished jobs have been applied (`drain`): an idle step waits on it."""

    def step_end(self) -> tuple[list[Job], bool]:
        """The step's end, under the lock: the jobs to submit now (the runtime did not get the
        lock between the last two steps: its work is done here), and whether to nudge the
        runtime for the between-step work."""
        arrivals = self.arrivals
        arrivals.step += 1
        step = arrivals.step
        self.promoter.refused.clear()
        if self.fences.due(step):
            self.fences.flushed()  # the copies in flight at the last reset have ended
        if self.work_queued or (arrivals.queue and arrivals.since < step - 1):
            self.counters[BOOKKEEPING_ON_SCHEDULER] += 1
            self.between()
            return self.sink.take(), False  # (the facade submits them after the step)
        if not self.work_queued and self.between_due():
            self.work_queued = True
            return [], True
        return [], False

    def idle_wait(self, idle: bool) -> bool:
        """Claim urgency while the engine waits on the tiers; whether an `idle` step should
        wait for a result (`progress`, cleared here under the lock: none is applied before)."""
        urgent = self.urgent()
        self.urgency.set(urgent)
        if idle and (urgent or self.warm.warming):
            self.counters[IDLE_WAITS] += 1
            self.progress.clear()
            return True
        return False

    def pending(self) -> bool:
        """Work the engine must keep stepping for (read without the lock). A warm start's batch
        is not, until a request waits on one of its blocks: the runtime applies its result."""
        return bool(
            self.runtime.pending() > self.warm.unasked()
            or self.arrivals.queue
            or self.work_queued
            or self.ticking
            or self.locator.to_check
            or self.sink.outbox
            or self.demoter.through
            or self.promoter.pending()
        )

    def urgent(self) -> bool:
        """Promotions or existence checks the engine waits on are in flight (a late promotion's
        key reads MISS: the engine recomputes it and waits on nothing; `late` is a subset of
        `promoting`; so is a warm start's batch, whose keys no lookup asked for are in
        `WarmStart.keys`, disjoint from `late`). Under the lock."""
        if self.closed:
            return False
        promoter = self.promoter
        waited = len(promoter.promoting) - len(promoter.late) - len(self.warm.keys)
        return waited > 0 or bool(self.locator.checking)

    def between_due(self) -> bool:
        """Whether the runtime has between-step work (under the lock)."""
        if self.locator.to_check or self.promoter.queued or self.demoter.through:
            return True
        return self.write_back and self.demoter.due()

    def on_tick(self) -> bool:
        """The runtime's hook, on its thread at every tick: apply finished jobs, mark late
        promotions, and do the between-step work once a step has handed it over. Never waits
        for the lock: if the scheduler holds it, next tick. Whether it did or has work."""
        warm = self.warm
        if not (
            self.arrivals.queue
            or self.work_queued
            or self.promoter.overdue()
            or self.fences.stuck
            or warm.due()
        ):
            return False
        assert self.runtime.on_loop_thread(), "the runtime's hook called off its thread"
        if not self.lock.try_acquire():
            return True
        self.ticking = True
        try:
            start, cpu = time.perf_counter(), time.thread_time()
            if self.work_queued:
                self.between()
            else:
                self.drain()
            if warm.due() and not self.closed:
                warm.submit()
            self.fences.release_stuck()
            jobs = self.sink.take()
            if jobs:
                self.runtime.submit_from_loop(jobs)
            self.urgency.set(self.urgent())
            self.counters[BOOKKEEPING_SECONDS] += time.perf_counter() - start
            self.counters[BOOKKEEPING_CPU_SECONDS] += time.thread_time() - cpu
        finally:
            self.ticking = False
            self.lock.release()
        return True

    def between(self) -> None:
        """Apply finished jobs, submit the queued checks, write-through demotions and
        promotions (allocating their slots), and reclaim for write-back demotions. Between two
        steps only: allocating and reclaiming evict blocks."""
        assert self.lock.owned()
        self.work_queued = False
        self.drain()
        self.locator.submit_checks()
        self.demoter.demote_through()
        self.promoter.submit()
        self.demoter.reclaim()

    def drain(self) -> None:
        """Apply the finished jobs, and mark promotions past their deadline late."""
        assert self.lock.owned()
        promoter = self.promoter
        late = promoter.mark_late(self.clock())
        if late:
            self.warm.late(late)
        queue = self.arrivals.queue
        if queue or late:  # a late key reads MISS: the waiting request may recompute now
            self.progress.set()  # (seen once the lock is released, after these are applied)
        generation, tiers = self.sink.generation, self.tiers
        while queue:
            result = queue.popleft()
            job: TierJob = result.tag
            if job.generation != generation:
                continue  # from before a reset
            state = tiers[job.tier]
            if result.ok and result.fault is None:
                state.latencies.append(result.seconds)
            else:  # failed, refused, or a batch that faulted (`JobResult.fault`)
                state.counters[ERRORS] += 1
            match job:
                case ExistenceCheck(keys=keys):
                    present = answers(result, len(keys), False)
                    self.locator.answered(state, keys, present, self.clock())
                case Promotion():
                    found = promoter.promoted(state, job, result)
                    if job.bulk:
                        self.warm.promoted(state, job, result, found)
                case Demotion():
                    self.demoter.demoted(state, job, result)

    def forget(self) -> None:
        """A reset, under the lock: results of the jobs submitted so far will be dropped, and
        every piece forgets what it queued or had in flight."""
        assert self.lock.owned()
        self.sink.generation += 1
        self.arrivals.queue.clear()
        self.work_queued = False
        self.sink.outbox.clear()
        self.locator.clear()
        self.promoter.clear()
        self.warm.clear()
        self.demoter.clear()
        self.history.clear()
        self.urgency.set(False)
