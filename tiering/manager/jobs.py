"""The manager's job records: what each job it submits to the runtime was for.

A record rides in `Job.tag` and comes back in `JobResult.tag`; the manager dispatches on its
type with `match` (`TieringOffloadingManager._drain`). The records are typed named tuples, not
frozen dataclasses: one is made for every job, and a frozen dataclass's constructor costs
several times a tuple's on the runtime's bookkeeping (BENCHMARKS.md, "The tiering manager on
the shared trace": the runtime's thread per block). Each carries the `generation` it was
submitted in: a result from before a `reset` is dropped. The coroutine factories here build
their slot views on the runtime's thread, so a job costs the scheduler no view.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

from tiering.keys import BlockKey
from tiering.runtime import JobResult
from tiering.tier import Tier

__all__ = [
    "Demotion",
    "ExistenceCheck",
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
    warm: bool = False
    """Read at start (`primary.warm_start`), not for a lookup."""


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
