"""A driver of vLLM 0.32's step protocol, for the tests, the replay and the benches.

vLLM's `OffloadingConnector` calls a manager in a fixed order within each engine step: for each
request, `lookup` of its keys in order until the first MISS (a HIT counts; PENDING counts and
defers the request; RETRY defers it and the scan goes on, so the manager can look further keys
up in the same step); for an admitted request, `prepare_load` of its leading hits, then
`prepare_store` of the rest (the worker copies into the granted slots, and `complete_store`
follows), `complete_load` once the load is done; and `on_schedule_end` once per step. A
deferred request is looked up again, whole, at the next step.

`StepDriver` makes those calls, times each (per method: `seconds`, `blocks`, `slowest`), and
gives the runtime the time between steps. It is pure: no pytest, no vLLM, no threads of its
own; it plays the scheduler's thread.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from tiering.keys import BlockKey
from tiering.primary import LookupResult, StoreGrant

__all__ = ["Scan", "StepDriver", "SteppedManager"]

_T = TypeVar("_T")
_HIT, _MISS = LookupResult.HIT, LookupResult.MISS


class SteppedManager(Protocol):
    """Scheduler process, the scheduler's thread: the calls vLLM's connector makes
    (`TieringOffloadingManager` serves them)."""

    def lookup(self, key: BlockKey) -> LookupResult: ...
    def prepare_load(self, keys: Sequence[BlockKey]) -> list[int]: ...
    def complete_load(self, keys: Iterable[BlockKey]) -> None: ...
    def prepare_store(self, keys: Iterable[BlockKey]) -> StoreGrant | None: ...
    def complete_store(self, keys: Iterable[BlockKey], ok: bool = True) -> None: ...
    def on_schedule_end(self) -> None: ...
    def has_pending_work(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class Scan:
    """Any thread (a frozen value): one request's lookups, as vLLM's connector reads them."""

    hits: int
    """Leading keys usable now (all the HITs before the first MISS, once nothing defers)."""
    deferred: bool
    """A key answered PENDING or RETRY: the request waits for the next step."""
    waited: frozenset[BlockKey]
    """The keys that answered PENDING or RETRY, over every scan of the request."""
    settled: bool = True
    """False when the request was still deferred after the most scans allowed."""


class StepDriver:
    """Drives one manager through vLLM's step protocol. Scheduler process, the caller's thread
    (it plays the scheduler's)."""

    def __init__(
        self,
        manager: SteppedManager,
        *,
        fill: Callable[[BlockKey, int], None] | None = None,
        idle_timeout: float = 5.0,
        poll: float = 0.001,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """`fill(key, slot)` writes a stored block's bytes into its primary slot (the worker's
        copy); `idle_timeout` and `poll` bound and pace `wait_idle`."""
        self.manager = manager
        self.fill = fill
        self.idle_timeout = idle_timeout
        self.poll = poll
        self.clock = clock
        self.seconds: dict[str, float] = {}
        """Seconds spent inside each manager method (waits excluded)."""
        self.blocks: dict[str, int] = {}
        """Blocks handed to each method (a lookup: one; `on_schedule_end`: one per step)."""
        self.slowest = 0.0
        """The longest single call, in seconds."""
        self._lookup = manager.lookup
        self._prepare_load = manager.prepare_load
        self._complete_load = manager.complete_load
        self._prepare_store = manager.prepare_store
        self._complete_store = manager.complete_store
        self._on_schedule_end = manager.on_schedule_end

    @property
    def spent(self) -> float:
        """Seconds spent inside the manager's calls in all."""
        return sum(self.seconds.values())

    def timed(self, name: str, function: Callable[..., _T], *args: Any) -> _T:
        """`function(*args)`, its time counted under `name` (a call beyond the protocol's, such
        as `TieringOffloadingManager.record`)."""
        return self._timed(name, function, *args)

    def _timed(self, name: str, function: Callable[..., _T], *args: Any) -> _T:
        start = self.clock()
        try:
            return function(*args)
        finally:
            seconds = self.clock() - start
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds
            n = len(args[0]) if args and isinstance(args[0], list) else 1
            self.blocks[name] = self.blocks.get(name, 0) + n
            if seconds > self.slowest:
                self.slowest = seconds

    # -- the calls -------------------------------------------------------------------------------

    def lookup(self, key: BlockKey) -> LookupResult:
        return self._timed("lookup", self._lookup, key)

    def prepare_load(self, keys: list[BlockKey]) -> list[int]:
        return self._timed("prepare_load", self._prepare_load, keys)

    def complete_load(self, keys: list[BlockKey]) -> None:
        self._timed("complete_load", self._complete_load, keys)

    def prepare_store(self, keys: list[BlockKey]) -> StoreGrant | None:
        return self._timed("prepare_store", self._prepare_store, keys)

    def complete_store(self, keys: list[BlockKey], ok: bool = True) -> None:
        self._timed("complete_store", self._complete_store, keys, ok)

    def end_step(self) -> None:
        """`on_schedule_end`: the step is over."""
        self._timed("on_schedule_end", self._on_schedule_end)

    # -- the protocol ----------------------------------------------------------------------------

    def store(self, keys: Sequence[BlockKey]) -> StoreGrant | None:
        """`prepare_store`, the worker's copy (`fill`) into each granted slot, and
        `complete_store` of the granted keys; the grant (None: refused, nothing stored)."""
        grant = self.prepare_store(list(keys))
        if grant is None:
            return None
        if self.fill is not None:
            for key, slot in zip(grant.keys, grant.slots, strict=True):
                self.fill(key, slot)
        self.complete_store(list(grant.keys))
        return grant

    def scan(self, keys: Sequence[BlockKey]) -> Scan:
        """One pass of `lookup` over a request's keys, as vLLM's connector reads it."""
        hits, deferred = 0, False
        waited: set[BlockKey] = set()
        for key in keys:
            result = self.lookup(key)
            if result is _MISS:
                break
            if result is _HIT and not deferred:
                hits += 1
            elif result is not _HIT:
                deferred = True
                waited.add(key)
        return Scan(hits, deferred, frozenset(waited))

    def admit(
        self,
        keys: Sequence[BlockKey],
        *,
        max_scans: int,
        between: Callable[[], None] | None = None,
    ) -> Scan:
        """Scan a request until nothing defers it, with a step (`between`, default `step`)
        after each deferral; after `max_scans` scans its leading hits are used
        (`settled=False`)."""
        between = between or self.step
        waited: set[BlockKey] = set()
        scan = Scan(0, False, frozenset())
        for _ in range(max_scans):
            scan = self.scan(keys)
            waited |= scan.waited
            if not scan.deferred:
                return Scan(scan.hits, False, frozenset(waited))
            between()
        return Scan(scan.hits, True, frozenset(waited), settled=False)

    def serve(self, keys: Sequence[BlockKey], hits: int) -> StoreGrant | None:
        """An admitted request: load its `hits` leading keys, store the rest, end the load."""
        loaded = list(keys[:hits])
        self.prepare_load(loaded)
        grant = self.store(keys[hits:])
        self.complete_load(loaded)
        return grant

    def lookup_until(
        self,
        key: BlockKey,
        until: Collection[LookupResult] = (LookupResult.HIT, LookupResult.MISS),
        *,
        steps: int = 20,
        between: Callable[[], None] | None = None,
    ) -> list[LookupResult]:
        """Look `key` up, with a step (`between`, default `step`) after each other answer,
        until an answer in `until` or `steps` lookups; every answer, in order."""
        between = between or self.step
        seen: list[LookupResult] = []
        for _ in range(steps):
            result = self.lookup(key)
            seen.append(result)
            if result in until:
                return seen
            between()
        return seen

    # -- time between steps ----------------------------------------------------------------------

    def wait_idle(self, timeout: float | None = None, poll: float | None = None) -> bool:
        """Let the runtime work until the manager has no pending work (or `timeout` seconds,
        default `idle_timeout`; `math.inf`: no bound); whether it is idle."""
        timeout = self.idle_timeout if timeout is None else timeout
        poll = self.poll if poll is None else poll
        deadline = time.monotonic() + timeout if timeout != math.inf else math.inf
        pending = self.manager.has_pending_work
        while pending():
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll)
        return True

    def step(self) -> None:
        """End the step and give the runtime the time between steps."""
        self.end_step()
        self.wait_idle()

    def settle(self, steps: int = 3) -> None:
        """Run at least `steps` steps, and more until the runtime is idle (at most 200), then
        end one more step so the last results are applied."""
        for _ in range(200):
            self.step()
            steps -= 1
            if steps <= 0 and not self.manager.has_pending_work():
                self.end_step()
                return
