"""A reset of the manager, with the slots it keeps out of use: its fences and its quarantine.

A reset forgets the primary and every job; the tiers keep their blocks. Two kinds of copies may
still touch primary slots after it:

- **quarantine**: tier jobs that did not end within the reset's drain (a hung disk). Every slot
  in use at the reset may be theirs: all stay out of the free list until those jobs have ended
  (`release_stuck`, at a runtime tick).
- **fence** (`reset(fence=True)`): the engine's own copies in flight at the reset (stores into
  slots, loads out of them). Every slot in use stays out of the free list until `flushed` says
  they have all ended (vLLM 0.33's `on_reset_flushed`), or, with `fence_steps`, until that many
  steps have ended when the engine never says (vLLM 0.32: it runs and waits for the copies in
  flight at a reset in the next step, so they have ended once the steps that can be in flight
  meanwhile have). A slot both fenced and quarantined is freed by the later of the two.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

from tiering.manager.counters import RESET_SLOTS_FENCED, RESET_SLOTS_QUARANTINED
from tiering.manager.steplock import StepLock
from tiering.primary import PrimaryPool
from tiering.runtime import Runtime

__all__ = ["ResetFences"]


class ResetFences:
    """The manager's resets and the slots they hold. Scheduler process: `reset` outside a step
    (it waits), the rest under the step lock (scheduler or runtime thread)."""

    __slots__ = (
        "_fence_until",
        "_fenced",
        "_quarantined",
        "clock",
        "counters",
        "lock",
        "pool",
        "runtime",
        "stuck",
    )

    def __init__(
        self,
        pool: PrimaryPool,
        runtime: Runtime,
        lock: StepLock,
        counters: defaultdict[str, float],
        clock: Callable[[], float],
    ) -> None:
        self.pool = pool
        self.runtime = runtime
        self.lock = lock
        self.counters = counters
        self.clock = clock
        self.stuck: set[int] = set()
        """Jobs that outlived a reset's drain."""
        self._quarantined: set[int] = set()  # their possible slots, held until they end
        self._fenced: set[int] = set()  # slots held by a fenced reset until `flushed`
        self._fence_until: int | None = None  # or until this many steps (`fence_steps`)

    def reset(
        self,
        drain_timeout: float,
        *,
        fence: bool,
        fence_steps: int | None,
        step: int,
        drain: Callable[[], None],
        forget: Callable[[], None],
    ) -> None:
        """Wait up to `drain_timeout` for the jobs in flight (they may be writing or reading
        primary slots), apply what ended (`drain`), then reset the primary, keeping out of use
        the slots a stuck job or (`fence`) the engine's copies may still touch, and forget
        every job (`forget`). `step`: the steps ended so far (`fence_steps` counts from it)."""
        deadline = self.clock() + drain_timeout
        runtime = self.runtime
        while runtime.pending() and self.clock() < deadline:
            time.sleep(0.001)
        with self.lock.held():
            # Apply what ended first: a finished job's slots are then no longer in use, and
            # only those of the engine's copies and of jobs that did not end are held below.
            drain()
            stuck = runtime.pending_ids()
            keep: set[int] = set()
            if stuck:  # jobs that did not end (a hung disk): their slots stay out of use
                keep = self.pool.slots_in_use() | self._quarantined
                self.counters[RESET_SLOTS_QUARANTINED] += len(keep - self._quarantined)
                self.stuck |= stuck
            self._quarantined = keep
            if fence:
                fenced = self.pool.slots_in_use()
                self.counters[RESET_SLOTS_FENCED] += len(fenced - self._fenced)
                self._fenced = fenced
                self._fence_until = None if fence_steps is None else step + fence_steps
            self.pool.reset(keep | self._fenced)
            forget()

    def due(self, step: int) -> bool:
        """Whether a fence for some steps has lasted them, at the end of step `step`."""
        return self._fence_until is not None and step >= self._fence_until

    def flushed(self) -> None:
        """The engine's copies in flight at the last fenced reset have all ended: the slots
        they could touch go back to the free list (those a stuck job may still use stay held
        until it ends). Under the lock."""
        assert self.lock.owned()
        if self._fenced:
            self.pool.release(self._fenced - self._quarantined)
            self._fenced = set()
        self._fence_until = None

    def release_stuck(self) -> None:
        """At a runtime tick, under the lock: once the jobs a reset outlived have ended, their
        possible slots go back to the free list (a fence may hold some longer)."""
        if self.stuck and self.stuck.isdisjoint(self.runtime.pending_ids()):
            self.pool.release(self._quarantined - self._fenced)
            self.stuck, self._quarantined = set(), set()
