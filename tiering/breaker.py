"""Circuit breakers: each tier has two, its breaker, which every job of the tier passes, and a
write breaker, which jobs that write (`Job.writes`: demotions) pass too.

A breaker opens after `failures` consecutive failed jobs, refuses its jobs at once while open
(reported failed, with no call to the tier), lets exactly one job through as a probe after
`cooldown` (half-open), and closes when the probe succeeds (it opens again, for another
cooldown, when the probe fails). Only the probe's outcome moves a half-open breaker; a job
admitted before the breaker opened that ends later changes nothing.

What a job's outcome is, for the breakers (`fault_of`):
- it *faulted* when it raised, or when its value is a list (a batch: `Tier.get_many`,
  `put_many`, ... answer per item, with the exceptions in place) in which at least half of the
  items are exceptions (all of a one-item batch). A dead server fails every item of every
  batch; one item lost in a large batch of a tier that serves the rest is a counted error, not
  a reason to cut the tier off (with "any item", a 1% per-item error rate fails 92% of
  256-block batches, and five such in a row open the breaker of a tier that works): a failure
  rate of one half per job is the threshold circuit breakers commonly default to. An exception
  is the tier's fault whatever its type (an untranslated library error too), except a
  `CorruptObject`: that is the data's fault, a counted miss, never a breaker failure;
- it *succeeded* otherwise (misses are answers); a job slower than `latency` counts as a failure.

Which breaker a fault counts against: `TierFull` only against the write breaker of a job that
writes (a full tier still answers, and serves what it holds: promotions go on from a full disk
while writes are refused); other faults (unavailable, timed out: nothing gets through), when
they alone are half a batch or more, against the tier's breaker and, for a job that writes, its
write breaker too. A job's per-item results reach its submitter unchanged (`JobResult.ok` stays
True for a batch that answered); `JobResult.fault` says what the breakers counted.

The runtime (`tiering.runtime`) admits its jobs here and records their outcomes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from tiering.config import BreakerConfig
from tiering.errors import CorruptObject, TierError, TierFull, TierUnavailable

__all__ = ["Breaker", "fault_of"]

log = logging.getLogger(__name__)


class Breaker:
    """One tier's breaker, or its write breaker: closed, open or half-open. Any thread: jobs
    are admitted on the submitting threads and recorded on the runtime's, under a lock (so a
    half-open breaker lets exactly one probe through); a state read is one attribute load."""

    def __init__(
        self, name: str, config: BreakerConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.name = name
        """What it guards, for messages: `tier 'redis'`, `writes to tier 'nvme'`."""
        self.config = config
        self.clock = clock
        self.state = "closed"
        self.failures = 0
        """Consecutive failures while closed."""
        self.opened_at = 0.0
        self.opened = 0  # times it opened, a failed probe's reopening too (a metric)
        self.refused = 0  # jobs it refused (a metric)
        self.last_fault: BaseException | None = None
        self._epoch = 0  # bumped when it opens: outcomes of jobs admitted before are stale
        self._probing = False  # the half-open breaker's probe is out
        self._lock = threading.Lock()

    def admit(self) -> int | None:
        """A ticket for a job to pass (give it back to `record` or `cancel`), or None: refused."""
        epoch = self._epoch  # read first: a job admitted as the breaker opens has a stale
        if self.state == "closed":  # ticket, and is not counted (the common case: no lock)
            return epoch
        with self._lock:
            if self.state == "open" and self.clock() - self.opened_at >= self.config.cooldown:
                self.state = "half-open"
            if self.state == "half-open" and not self._probing:
                self._probing = True
                return self._epoch
            if self.state == "closed":
                return self._epoch
            self.refused += 1
            return None

    def cancel(self, ticket: int) -> None:
        """An admitted job did not run after all (another breaker refused it): a probe's turn
        goes to the next job."""
        with self._lock:
            if ticket == self._epoch and self.state == "half-open":
                self._probing = False

    def record(
        self, ticket: int, ok: bool, seconds: float, fault: BaseException | None = None
    ) -> None:
        """The outcome of a job admitted with `ticket`: `ok` unless it faulted (`fault`, the
        reason, for the log); a call slower than `latency` counts as a failure too."""
        slow = self.config.latency is not None and seconds > self.config.latency
        with self._lock:
            if ticket != self._epoch:
                return  # admitted before the breaker opened: only the probe decides now
            if ok and not slow:
                if self.state == "half-open":
                    log.warning("%s: circuit breaker closes (its probe succeeded)", self.name)
                self.state, self.failures, self._probing = "closed", 0, False
                return
            self.failures += 1
            self.last_fault = fault or self.last_fault
            reason = fault or (f"slower than {self.config.latency:g}s" if slow else "failed")
            if self.state == "half-open":
                log.info(
                    "%s: the probe failed (%s); open for %gs more",
                    self.name,
                    reason,
                    self.config.cooldown,
                )
            elif self.failures >= self.config.failures:
                log.warning(
                    "%s: circuit breaker opens after %d consecutive failed jobs (last: %s); "
                    "refusing its jobs for %gs, then one probes",
                    self.name,
                    self.failures,
                    reason,
                    self.config.cooldown,
                )
            else:
                return
            self.state, self.opened_at, self._probing = "open", self.clock(), False
            self._epoch += 1
            self.opened += 1

    def refusal(self) -> TierError:
        """The error of a job this breaker refused: `TierFull` while it is open for a full
        tier, `TierUnavailable` otherwise."""
        fault = self.last_fault
        kind = TierFull if isinstance(fault, TierFull) else TierUnavailable
        why = f"last fault: {fault}" if fault else "slow calls"
        return kind(f"{self.name}: circuit breaker open ({why})")

    def after_fork(self) -> None:
        """In a forked child: another thread of the parent may have held the lock."""
        self._lock = threading.Lock()


def fault_of(value: Any) -> BaseException | None:
    """The fault a job's value holds, for the breakers (module docstring): None when the value
    is no batch or fewer than half of its items faulted (a `CorruptObject` is no fault); else
    one of the faults: not a `TierFull` where those alone are half the items or more (it counts
    against the tier's breaker too), a `TierFull` otherwise."""
    if not isinstance(value, list):
        return None
    full: list[BaseException] = []
    down: list[BaseException] = []
    for item in value:
        if isinstance(item, BaseException) and not isinstance(item, CorruptObject):
            (full if isinstance(item, TierFull) else down).append(item)
    if 2 * len(down) >= len(value) > 0:
        return down[0]
    if 2 * (len(full) + len(down)) >= len(value) > 0:
        return full[0]
    return None
