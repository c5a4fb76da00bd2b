"""Where each block is known to be, among the tiers whose index cannot say.

A tier with an index answers `knows(key)` without I/O; the others (Redis, S3) are asked by
batched existence checks, and so is an indexed tier for a key its index lacks while other
processes write its store (a `files` directory several engines share: its `knows` answers
None then). The answers are remembered for a while: found in tier `i` for `POSITIVE_TTL`
seconds (demoted there, or found there), found nowhere for `NEGATIVE_TTL` seconds (so a block
no tier has is not looked for again every step; a failed promotion is remembered the same
way). A key being looked for waits for every asked tier's answer and goes to the first one, in
order, that has it. A block another engine stores is therefore found within `NEGATIVE_TTL`
(and one check) of being stored.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Final, Literal

from tiering.keys import BlockKey
from tiering.manager.counters import FOUND, LOOKUPS, NOT_FOUND
from tiering.manager.jobs import JobSink
from tiering.manager.tierstate import TierState

__all__ = ["ABSENT", "ASKING", "NEGATIVE_TTL", "POSITIVE_TTL", "TierLocator"]

ABSENT = -1
"""The tier index of a block found in no tier."""
NEGATIVE_TTL = 2.0
"""Seconds a block found in no tier is taken as absent before it is looked for again."""
POSITIVE_TTL = 30.0
"""Seconds a block found in (or demoted to) a tier without an index is taken as there."""


class _Asking(enum.Enum):
    ASKING = "asking"


ASKING: Final = _Asking.ASKING
"""`TierLocator.find`'s answer for a block the tiers are being asked about: ask again later."""


class TierLocator:
    """Where blocks are known to be. Scheduler process, under the step lock (scheduler or
    runtime thread).

    `known` maps a key to `(tier index or ABSENT, expiry)`; `checking` the keys whose check
    is out to the tiers yet to answer; `to_check` the keys queued this step. A lookup asks
    `find` one question: the tier to promote a block from, none, or ask again later.
    """

    __slots__ = (
        "_found",
        "_knows",
        "checked",
        "checking",
        "clock",
        "indexed",
        "known",
        "sink",
        "tiers",
        "timeout",
        "to_check",
    )

    def __init__(
        self,
        tiers: Sequence[TierState],
        sink: JobSink,
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`sink` takes the checks; `timeout` is a check's deadline (`faults.timeout`)."""
        self.tiers = list(tiers)
        self.sink = sink
        self.timeout = timeout
        self.clock = clock
        self.checked = [t for t in self.tiers if not t.indexed]
        """The tiers asked by every existence check."""
        self.indexed = [t for t in self.tiers if t.indexed]
        """The tiers asked about the keys their index cannot say (`knows` None)."""
        self._knows = [(t.tier.knows, t) for t in self.indexed]
        """The indexed tiers' `knows`, in order: `find` asks them without I/O."""
        self.known: dict[BlockKey, tuple[int, float]] = {}
        self.checking: dict[BlockKey, set[int]] = {}
        self._found: dict[BlockKey, set[int]] = {}
        self.to_check: list[BlockKey] = []

    def find(self, key: BlockKey) -> TierState | Literal[_Asking.ASKING] | None:
        """Where to promote `key` from: the first indexed tier whose index has it, else the
        tier a fresh answer names; None when no tier has it (as far as one can say now);
        `ASKING` when the tiers are being asked (the check is queued here, submitted at the
        end of the step)."""
        unsure = False  # an indexed tier whose store others write cannot say (None)
        for knows, state in self._knows:
            here = knows(key)
            if here:
                return state
            if here is None:
                unsure = True
        if not (self.checked or unsure):
            return None
        known = self.known.get(key)
        if known is not None and known[1] > self.clock():
            return None if known[0] == ABSENT else self.tiers[known[0]]
        self.queue_check(key)
        return ASKING

    def queue_check(self, key: BlockKey) -> None:
        """Look for `key` in the checked tiers (submitted at the end of the step)."""
        if key not in self.checking:
            self.checking[key] = set()
            self.to_check.append(key)

    def submit_checks(self) -> None:
        """Add one existence check per tier to ask, of the keys queued, to the sink: every
        checked tier gets them all, an indexed tier those it cannot say (a key no tier is left
        to ask is looked up afresh at its next lookup)."""
        if not self.to_check:
            return
        keys = list(self.to_check)
        self.to_check.clear()  # cleared in place: the manager reads it directly
        asked = [(state, keys) for state in self.checked]
        for state in self.indexed:
            knows = state.tier.knows
            unsure = [key for key in keys if knows(key) is None]
            if unsure:
                asked.append((state, unsure))
        for key in keys:
            self.checking[key] = set()
            self._found[key] = set()
        for state, ask in asked:
            for key in ask:
                self.checking[key].add(state.index)
        for key in keys:
            if not self.checking[key]:
                del self.checking[key], self._found[key]
        check, timeout = self.sink.check, self.timeout
        for state, ask in asked:
            check(state, ask, timeout)
            state.counters[LOOKUPS] += len(ask)

    def answered(
        self, state: TierState, keys: list[BlockKey], present: list[bool], now: float
    ) -> None:
        """`state`'s tier's answers to a check; a key all tiers answered is located."""
        for key, here in zip(keys, present, strict=True):
            waiting = self.checking.get(key)
            if waiting is None:
                continue
            waiting.discard(state.index)
            if here:
                self._found[key].add(state.index)
                state.counters[FOUND] += 1
            else:
                state.counters[NOT_FOUND] += 1
            if not waiting:
                del self.checking[key]
                found = self._found.pop(key)
                if found:
                    self.known[key] = (min(found), now + POSITIVE_TTL)
                else:
                    self.known[key] = (ABSENT, now + NEGATIVE_TTL)

    def found_in(self, keys: Iterable[BlockKey], index: int, now: float) -> None:
        """`keys` are in tier `index` now (demoted there)."""
        self.known.update(dict.fromkeys(keys, (index, now + POSITIVE_TTL)))

    def absent(self, keys: Iterable[BlockKey], now: float) -> None:
        """`keys` are in no tier, for a while (a promotion failed)."""
        self.known.update(dict.fromkeys(keys, (ABSENT, now + NEGATIVE_TTL)))

    def holds(self, state: TierState, key: BlockKey, now: float) -> bool:
        """Whether `state`'s tier is known to hold `key` (its index says so, or it was demoted
        there or found there lately)."""
        if state.indexed:
            return bool(state.tier.knows(key))
        return known_at(self.known.get(key), state.index, now)

    def where(self, key: BlockKey) -> TierState | None:
        """The first tier known to hold `key` (expired entries count: a hint for reports)."""
        for state in self.tiers:
            if state.indexed and state.tier.knows(key):
                return state
        known = self.known.get(key)
        return None if known is None or known[0] == ABSENT else self.tiers[known[0]]

    def clear(self) -> None:
        self.known.clear()
        self.checking.clear()
        self._found.clear()
        self.to_check.clear()


def known_at(where: tuple[int, float] | None, index: int, now: float) -> bool:
    """Whether a `known` entry says tier `index` holds the block, and is still fresh."""
    return where is not None and where[0] == index and where[1] > now
