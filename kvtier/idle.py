"""Idle namespaces and their purge (`kvtier purge --idle-for`), on the command's event loop: the
plan from one listing of the store, then each namespace taken only if it is still idle when its
turn comes.

A plan is a reading of the past: an engine that resumes a namespace after the listing writes
into a namespace the plan calls idle. So each namespace's turn (`purge_if_idle`) (1) lists its
keys, (2) reads its last write again, from the store, as the plan read it (`Tier.usage`), and
(3) deletes the listed keys only if it is still idle. A write before (2) keeps the namespace
whole; a write after (2) is of a key (1) did not list, and stays. The price is one more listing
of the store per namespace purged: an operator's command, run rarely, against a namespace lost
to a stale reading.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from kvtier.operations import purge_namespace, selected
from tiering.errors import KvtierError
from tiering.tier import NamespaceUsage, Tier

__all__ = [
    "IDLE_FLOOR",
    "IdlePlan",
    "PurgeOutcome",
    "idle_plan",
    "purge_idle",
    "purge_if_idle",
]

IDLE_FLOOR: Final = 3600.0
"""The shortest `--idle-for` a purge takes without `--force` (1 h). Longer than an engine still
serving a model pauses its writes (a restart, a rolling upgrade, a quiet spell at a low request
rate: minutes), and sixty times the resolution of the store's record of a last write (the Redis
marker is refreshed at most every 60 s; S3 times writes to the second): an idle time under it
is a typo (`1ms`, `5s` for `5d`) or a test, not a model nobody runs."""


@dataclass
class IdlePlan:
    """Which namespaces of a store an idle-for purge takes (any thread: a value)."""

    idle: list[NamespaceUsage] = field(default_factory=list)
    """Not written for the time asked, oldest first."""
    active: list[NamespaceUsage] = field(default_factory=list)
    """Written since."""
    unknown: list[NamespaceUsage] = field(default_factory=list)
    """The store cannot say when they were written: never purged by idleness."""


def idle_plan(usage: list[NamespaceUsage], idle_for: float, now: float | None = None) -> IdlePlan:
    """Split a store's namespaces (`Tier.usage`) by whether their last write is more than
    `idle_for` seconds before `now`."""
    now = time.time() if now is None else now
    plan = IdlePlan()
    for row in usage:
        if row.last_write is None:
            plan.unknown.append(row)
        elif now - row.last_write >= idle_for:
            plan.idle.append(row)
        else:
            plan.active.append(row)
    plan.idle.sort(key=lambda row: row.last_write or 0.0)
    return plan


@dataclass(frozen=True, slots=True)
class PurgeOutcome:
    """What one namespace's turn did (a value): `deleted` blocks, or kept because it was
    written since the plan (`kept`, with its `last_write` as read again, None when the store
    can no longer tell), or failed (`error`, one line)."""

    namespace: bytes
    deleted: int = 0
    kept: bool = False
    last_write: float | None = None
    error: str | None = None


async def purge_if_idle(
    tier: Tier, idle_for: float, older_than: float | None = None
) -> PurgeOutcome:
    """Purge the namespace of `tier` (opened writable in it), or its blocks older than
    `older_than`, only if its last write, read again after its keys are listed, is still
    `idle_for` seconds old (the module's docstring says why in this order)."""
    keys = [info.key async for info in selected(tier, older_than)]
    row = next((u for u in await tier.usage() if u.namespace == tier.namespace), None)
    if row is None:  # nothing of it is left: another purge, or its blocks expired
        return PurgeOutcome(tier.namespace)
    if row.last_write is None or time.time() - row.last_write < idle_for:
        return PurgeOutcome(tier.namespace, kept=True, last_write=row.last_write)
    return PurgeOutcome(tier.namespace, deleted=await purge_namespace(tier, older_than, keys))


async def purge_idle(
    idle: list[NamespaceUsage],
    open_tier: Callable[[bytes], Tier],
    idle_for: float,
    older_than: float | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[PurgeOutcome]:
    """`purge_if_idle` for each namespace of a plan's `idle`, in a tier `open_tier` gives for
    it; a namespace that fails (held by a writer, a failing server) is an outcome with its
    error, and the others go on. `progress`, when given, is told how many namespaces are done
    after each."""
    done = []
    for row in idle:
        try:
            async with open_tier(row.namespace) as tier:
                done.append(await purge_if_idle(tier, idle_for, older_than))
        except KvtierError as e:
            done.append(PurgeOutcome(row.namespace, error=" ".join(str(e).split())))
        if progress is not None:
            progress(len(done))
    return done
