"""The manager's jobs: the sink its pieces put them in, and the records of what each was for.

The locator, the promoter and the demoter are each handed the manager's one `JobSink` when
they are built: they add their jobs to its outbox (submitted together, at the end of the step
or of the runtime's tick), and the sink stamps each with the generation and the done handler.
A record rides in `Job.tag` and comes back in `JobResult.tag`; the bookkeeping dispatches on
its type with `match` (`Bookkeeping.drain`). The records are typed named tuples, not
frozen dataclasses: one is made for every job, and a frozen dataclass's constructor costs
several times a tuple's on the runtime's bookkeeping (BENCHMARKS.md, "The tiering manager on
the shared trace": the runtime's thread per block). Each carries the `generation` it was
submitted in: a result from before a `reset` is dropped. The coroutine factories here build
their slot views on the runtime's thread, so a job costs the scheduler no view.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

from tiering.keys import BlockKey
from tiering.manager.tierstate import TierState
from tiering.runtime import Job, JobResult
from tiering.tier import Tier

__all__ = [
    "Demotion",
    "ExistenceCheck",
    "JobSink",
    "Promotion",
    "SlotHold",
    "TierJob",
    "answers",
    "get_into",
    "put_from",
]


class SlotHold(enum.Enum):
    """Any thread (a value): how a demotion holds the primary's bytes it reads, so its end
    gives back the right thing."""

    PINNED = "pinned"
    """Write-through: the keys are pinned (`pin_for_demotion`); the end unpins them."""
    HELD = "held"
    """Write-back: the slots were reclaimed and are held (the keys left the primary); the end
    of the last demotion reading a slot releases it."""
    COPY = "copy"
    """Evicted on the store path: the bytes were copied out; no slot to give back."""


class ExistenceCheck(NamedTuple):
    """Any thread (an immutable value): a batched `contains` of the keys looked up in a tier
    without an index."""

    generation: int
    tier: int
    keys: list[BlockKey]


class Promotion(NamedTuple):
    """Any thread (an immutable value): a batched `get_many` from a tier into freshly allocated
    primary slots."""

    generation: int
    tier: int
    batch: list[tuple[BlockKey, int]]
    """(key, slot) pairs."""
    bulk: bool = False
    """A background read no lookup asked for (the warm start's): its time says nothing of a
    request's promotion."""


class Demotion(NamedTuple):
    """Any thread (an immutable value): a batched `put_many` of primary blocks (or copies of them)
    to a tier."""

    generation: int
    tier: int
    keys: list[BlockKey]
    slots: list[int]
    """Where the keys are read from (empty for `SlotHold.COPY`)."""
    hold: SlotHold


TierJob = ExistenceCheck | Promotion | Demotion


class JobSink:
    """The manager's outbox of jobs for the runtime. Scheduler process, under the step lock
    (scheduler or runtime thread); `done` runs on the runtime's thread.

    `generation` is bumped by a reset (a result of an older job is dropped); `done` receives
    every job's result (`Arrivals.arrived`). The outbox is emptied by `take` alone."""

    __slots__ = ("done", "generation", "outbox")

    def __init__(self, done: Callable[[JobResult], None]) -> None:
        self.done = done
        self.generation = 0
        self.outbox: list[Job] = []

    def check(self, state: TierState, keys: list[BlockKey], timeout: float) -> None:
        """A batched existence check of `keys` in `state`'s tier."""
        self.outbox.append(
            Job(
                state.config.name,
                functools.partial(state.tier.contains, keys),
                timeout,
                tag=ExistenceCheck(self.generation, state.index, keys),
                done=self.done,
            )
        )

    def promotion(
        self,
        state: TierState,
        slot_view: Callable[[int], memoryview],
        batch: list[tuple[BlockKey, int]],
        deadline: float,
        bulk: bool,
    ) -> None:
        """A promotion of `batch` (allocated slots) from `state`'s tier; a `bulk` one is a
        background transfer."""
        self.outbox.append(
            Job(
                state.config.name,
                functools.partial(get_into, state.tier, slot_view, batch),
                deadline,
                tag=Promotion(self.generation, state.index, batch, bulk),
                done=self.done,
                bulk=bulk,
            )
        )

    def demotion(
        self,
        state: TierState,
        run: Callable[[], Awaitable[Any]],
        keys: list[BlockKey],
        slots: list[int],
        hold: SlotHold,
        timeout: float,
    ) -> None:
        """A demotion of `keys` (read from `slots`, or copies: `run` writes them) to `state`'s
        tier, the primary's bytes held as `hold`."""
        self.outbox.append(
            Job(
                state.config.name,
                run,
                timeout,
                tag=Demotion(self.generation, state.index, keys, slots, hold),
                done=self.done,
                writes=True,
            )
        )

    def take(self) -> list[Job]:
        """The jobs added since the last call, to submit."""
        jobs, self.outbox = self.outbox, []
        return jobs


def get_into(
    tier: Tier, slot_view: Callable[[int], memoryview], batch: list[tuple[BlockKey, int]]
) -> Awaitable[list[bool | BaseException]]:
    """A promotion, made on the runtime's thread."""
    return tier.get_many([(key, slot_view(slot)) for key, slot in batch])


def put_from(
    tier: Tier, slot_view: Callable[[int], memoryview], keys: list[BlockKey], slots: list[int]
) -> Awaitable[list[BaseException | None]]:
    """A demotion from primary slots, made on the runtime's thread."""
    return tier.put_many([(key, slot_view(slot)) for key, slot in zip(keys, slots, strict=True)])


def answers(result: JobResult, n: int, failed: Any) -> list[Any]:
    """A batch job's per-item answers; `failed` for each item when the job failed or a tier
    answered with the wrong number of items (a third-party tier's bug stays a miss here)."""
    value = result.value
    if not result.ok or not isinstance(value, list) or len(value) != n:
        return [failed] * n
    return value
