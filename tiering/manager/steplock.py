"""The manager's lock, held by the scheduler for a whole engine step.

The scheduler takes it at a step's first call (`begin`: `lookup`, `prepare_load`) and lets it
go at `on_schedule_end` (`end`): one acquisition per step, and a block looked up as HIT is never
reclaimed or evicted before the same step's `prepare_load`. Calls outside a step take it one at
a time (`call`, `held`). The runtime's thread never waits for it (`try_acquire`): it tries
again a tick later. The holder is recorded, so code that needs the lock asserts `owned()`.

A step that never ends starves the runtime's bookkeeping: the runtime's failed tries say so
once per step in the log (once they have failed for `STEP_WARN_AFTER` seconds). In a forked
child the lock is made afresh (the thread that held it stayed with the parent).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from tiering.runtime import at_fork_in_child

__all__ = ["STEP_WARN_AFTER", "StepLock"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_get_ident = threading.get_ident

STEP_WARN_AFTER = 10.0
"""Seconds a step may keep the runtime out before its failed tries are logged."""


class StepLock:
    """The step lock. Scheduler process: `begin`/`end`/`call`/`held` on the scheduler thread
    (or any caller outside a step), `try_acquire`/`release` on the runtime thread."""

    __slots__ = (
        "__weakref__",
        "_starved_since",
        "_forbidden",
        "_lock",
        "_owner",
        "_warned",
        "clock",
        "stepping",
    )

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        forbidden: Callable[[], bool] | None = None,
    ) -> None:
        """`forbidden()` says whether the calling thread must never wait for the lock (the
        runtime's own: its loop would stop, and with it the jobs the holder may wait for);
        `begin` and `acquire` assert it before they wait."""
        self.clock = clock
        self._forbidden = forbidden
        self._lock = threading.Lock()
        self._owner: int | None = None  # the holder's thread ident
        self.stepping = False
        """The scheduler holds the lock for the rest of the step."""
        self._starved_since: float | None = None  # the runtime's first failed try this step
        self._warned = False
        at_fork_in_child(self, StepLock._reset)

    # begin, end and call run on every step or call of the engine: written out, not layered
    # on acquire/release (a Python call each), so the step costs what a bare lock costs.

    def owned(self) -> bool:
        """Whether the calling thread holds the lock (for assertions)."""
        return self._owner == _get_ident()

    def begin(self) -> None:
        """The scheduler's step begins: hold the lock until `end`."""
        assert not self.stepping, "a step began inside a step"
        if not self._lock.acquire(False):
            self._wait()
        self._owner = _get_ident()
        self.stepping = True
        self._starved_since = None
        self._warned = False

    def end(self) -> None:
        """The step ends (a no-op outside a step). Another thread than the step's may end it
        (`shutdown` or `reset` from a cleanup thread after the scheduler's thread stopped
        mid-step): the lock is given back all the same, and that is logged."""
        if self.stepping:
            if self._owner != _get_ident():
                log.warning("kvtier: an engine step was ended by another thread than its own")
            self.stepping = False
            self._owner = None
            self._lock.release()

    def call(self, function: Callable[..., _T], *args: Any) -> _T:
        """`function(*args)` under the lock, unless the calling thread holds it for its step
        (another thread waits for that step to end)."""
        if self.stepping and self._owner == _get_ident():
            return function(*args)
        lock = self._lock
        if not lock.acquire(False):
            self._wait()
        self._owner = _get_ident()
        try:
            return function(*args)
        finally:
            self._owner = None
            lock.release()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold the lock for a block of code (inside the calling thread's step: the step's
        hold)."""
        if self.stepping and self._owner == _get_ident():
            yield
            return
        with self._hold():
            yield

    @contextlib.contextmanager
    def _hold(self) -> Iterator[None]:
        self.acquire()
        try:
            yield
        finally:
            self.release()

    def acquire(self) -> None:
        """Wait for the lock (outside a step: `reset`, calls between steps)."""
        if not self._lock.acquire(False):
            self._wait()
        self._owner = _get_ident()

    def _wait(self) -> None:
        """Wait for the lock, which is taken: never on a forbidden thread (it would wait for
        itself, or stop the runtime's loop)."""
        assert not (self._forbidden and self._forbidden()), (
            "a wait for the step lock on a thread that must never wait for it"
        )
        self._lock.acquire()

    def try_acquire(self) -> bool:
        """The lock if it is free, at once (the runtime's thread). A step that has kept the
        runtime out for `STEP_WARN_AFTER` seconds (from its first failed try) is logged, once."""
        if self._lock.acquire(False):
            self._owner = _get_ident()
            return True
        if not self.stepping or self._warned:
            return False
        now = self.clock()
        if self._starved_since is None:
            self._starved_since = now
        elif now - self._starved_since > STEP_WARN_AFTER:
            self._warned = True
            log.warning(
                "kvtier: an engine step has held the manager's lock for over %gs without "
                "on_schedule_end; the tiers' results wait until it ends",
                STEP_WARN_AFTER,
            )
        return False

    def release(self) -> None:
        assert self.owned(), "the step lock released by a thread that does not hold it"
        self._owner = None
        self._lock.release()

    def _reset(self) -> None:
        """In a forked child: the runtime's thread may have held the lock, and it stays with
        the parent."""
        self._lock = threading.Lock()
        self._owner = None
        self.stepping = False
