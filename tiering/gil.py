"""Hand the GIL over sooner while the engine waits on kvtier's threads.

A thread that wants the GIL back (after a read, a copy, a sleep) waits until the thread holding
it gives it up: at the latest after the interpreter's switch interval, 5 ms by default. While a
request waits for its blocks, vLLM's engine loop runs empty steps back to back and holds the
GIL between them, so every hand-back in kvtier's I/O path (the runtime's ticks, each read
group of a tier, the checks of what was read, the copy engine's jobs) waited about a whole
interval (what that cost a promotion: BENCHMARKS.md, "Time to first token").

While some owner has work the engine waits on (promotions or existence checks in flight, loads
being copied), the interval is `interval` (0.5 ms by default); when none has, the interval the
process had before comes back. The interval is the process's: another library that sets it
while kvtier holds it keeps its own value (kvtier restores only what it set).
"""

from __future__ import annotations

import os
import sys
import threading

__all__ = ["DEFAULT_INTERVAL", "Urgency", "configure", "holders"]

DEFAULT_INTERVAL = 0.0005
"""Seconds: the switch interval while kvtier's threads have work the engine waits on."""

_lock = threading.Lock()
_holders = 0
_interval = DEFAULT_INTERVAL
_generation = 0
"""Bumped in a forked child: claims made before the fork are not released there."""
_saved: float | None = None
"""The interval the process had when the first holder came (restored when the last leaves)."""
_set: float | None = None
"""The interval kvtier set, as the interpreter reads it back (whole microseconds)."""


def configure(interval: float) -> None:
    """The switch interval to use from the next claim on (0: leave the interpreter's)."""
    global _interval
    if interval < 0:
        raise ValueError(f"switch interval {interval}: expected 0 or more seconds")
    with _lock:
        _interval = interval


def holders() -> int:
    """Owners with work the engine waits on, now."""
    return _holders


class Urgency:
    """One owner's claim: `set(True)` while it has work the engine waits on, `set(False)` once
    it has none. Idempotent; any thread (the owner serializes its own calls)."""

    __slots__ = ("_on", "_generation")

    def __init__(self) -> None:
        self._on = False
        self._generation = _generation

    @property
    def on(self) -> bool:
        return self._on

    def set(self, on: bool) -> None:
        if on is self._on:
            return
        self._on = on
        if on:
            self._generation = _claim()
        elif self._generation == _generation:  # a claim from before a fork is gone already
            _release()


def _claim() -> int:
    global _holders, _saved, _set
    with _lock:
        _holders += 1
        if _holders == 1 and _interval > 0:
            current = sys.getswitchinterval()
            if current > _interval:
                _saved = current
                sys.setswitchinterval(_interval)
                _set = sys.getswitchinterval()
        return _generation


def _release() -> None:
    global _holders, _saved, _set
    with _lock:
        _holders = max(0, _holders - 1)
        if _holders == 0 and _saved is not None:
            # Restored only if the interval is still the one kvtier set.
            if sys.getswitchinterval() == _set:
                sys.setswitchinterval(_saved)
            _saved = _set = None


def _after_fork_in_child() -> None:
    """A forked child starts with no holder (their threads did not survive) and the interval
    the process had before kvtier's claim."""
    global _lock, _holders, _saved, _set, _generation
    _lock = threading.Lock()
    _holders = 0
    _generation += 1
    if _saved is not None:
        sys.setswitchinterval(_saved)
        _saved = _set = None


os.register_at_fork(after_in_child=_after_fork_in_child)
