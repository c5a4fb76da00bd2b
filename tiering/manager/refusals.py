"""Stores the primary refused: counted every time, said once per cause."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Sequence

from tiering.keys import BlockKey
from tiering.manager.counters import (
    STORE_BLOCKS_REFUSED,
    STORES_REFUSED_NO_ROOM,
    STORES_REFUSED_TOO_LARGE,
)
from tiering.primary import KeyState, PrimaryPool

__all__ = ["StoreRefusals"]

log = logging.getLogger(__package__)  # "tiering.manager": operators filter on the manager's name


class StoreRefusals:
    """The refused stores of one manager (one per scheduler process in vLLM). Scheduler
    process, under the step lock."""

    def __init__(
        self,
        pool: PrimaryPool,
        slot_view: Callable[[int], memoryview],
        capacity: int | None,
        counters: defaultdict[str, float],
    ) -> None:
        self.pool = pool
        self.slot_view = slot_view
        self.capacity = capacity
        """`primary.capacity` as configured (None: vLLM's `cpu_bytes_to_use`)."""
        self.counters = counters
        self._told: set[str] = set()

    def refused(self, keys: Sequence[BlockKey]) -> None:
        """Count a store the primary refused, and say why, once per cause: a request that
        needs more slots at once than the primary has (`stores_refused_too_large`: it is never
        offloaded, whatever happens), or one that finds too few free or evictable slots now
        (`stores_refused_no_room`: the rest are pinned, being written or held; vLLM offers the
        blocks again next step)."""
        pool = self.pool
        wanted = dict.fromkeys(keys)
        new = sum(1 for key in wanted if key not in pool)
        cause = "too_large" if len(wanted) > pool.num_slots else "no_room"
        self.counters[
            STORES_REFUSED_TOO_LARGE if cause == "too_large" else STORES_REFUSED_NO_ROOM
        ] += 1
        self.counters[STORE_BLOCKS_REFUSED] += new
        if cause in self._told:
            return
        self._told.add(cause)
        slot_bytes = len(self.slot_view(0))
        capacity = self.capacity
        now = "unset: vLLM's cpu_bytes_to_use" if capacity is None else size_text(capacity)
        if cause == "too_large":
            log.warning(
                "kvtier: a store of %d blocks (%d not in the primary) was refused: the primary "
                "has %d slots of %d bytes in all, fewer than the request needs at once, so no "
                "block of a request this long is offloaded. Raise primary.capacity (now %s) to "
                "at least %s (%d slots). Counted in stores_refused_too_large; said once.",
                len(wanted),
                new,
                pool.num_slots,
                slot_bytes,
                now,
                size_text(len(wanted) * slot_bytes),
                len(wanted),
            )
            return
        ready = pool.num_used - pool.num_writing - pool.num_reading
        protected = sum(1 for key in wanted if pool.state(key) is KeyState.READY)
        log.warning(
            "kvtier: a store of %d blocks (%d not in the primary) was refused: of the primary's "
            "%d slots of %d bytes, %d are free and %d evictable; %d are pinned (being loaded or "
            "demoted), %d being written, %d held by demotions. vLLM offers the blocks again "
            "next step; if this recurs, raise primary.capacity (now %s). Counted in "
            "stores_refused_no_room; said once.",
            len(wanted),
            new,
            pool.num_slots,
            slot_bytes,
            pool.num_free,
            ready - protected,
            pool.num_reading,
            pool.num_writing,
            pool.num_held,
            now,
        )


def size_text(n: int) -> str:
    """Bytes as a config writes them, rounded up to a tenth of the unit (`1.6GiB`)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{-(-n * 10 >> shift) / 10:g}{unit}"
    return str(n)
