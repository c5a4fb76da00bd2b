"""The replay's thread: how finely a shared tier's medium tells old objects from recent ones,
and whether a fleet replay gave it the wall-clock time to.

A medium that evicts by itself orders its objects by a clock of its own, and some tick
coarsely: Redis stamps a key's last use in seconds (`LRU_CLOCK_RESOLUTION`, 1000 ms, in its
`server.h`), and `allkeys-lru` evicts the longest idle of the keys it samples, so keys used
within the same second look equally old to it; S3's sweeper orders objects by `LastModified`,
which the server gives in seconds. Unpaced, a replay runs a fleet's minutes in seconds: the
blocks the tier holds are all replaced within a few ticks, and the medium evicts at random
among those of a tick, which a real fleet, whose tier turns over in minutes, does not see. So
the replay says how many ticks the tier's eviction horizon spanned (`FleetResult.horizon_ticks`),
and `--pace` replays the trace at a given speed in wall-clock time until it spans enough.

Measured (BENCHMARKS.md, the fleet replay against the model): Redis with `maxmemory-samples 64`
lands 1.9 points below the model at the blocks it held when its horizon spans 6 ticks, 0.2
points below at 41 (3,000 requests) and 0.05 at 35 (6,000). S3 (SeaweedFS, the sweeper by
write order) lands 0.01 points from the write-order model at its held blocks, unpaced: its calls
keep the replay slow enough that the horizon spans 146 ticks (6,000 requests).
"""

from __future__ import annotations

from kvtier.fleet.figures import FleetResult

__all__ = ["ENOUGH_TICKS", "RECENCY_TICK", "STAT_TOUCHES", "coarse_clock_note"]

RECENCY_TICK = {"redis": 1.0, "s3": 1.0}
"""Seconds per tick of the clock each medium evicts by, by tier type (the others: exact, or
kvtier's own order)."""
STAT_TOUCHES = frozenset({"redis"})
"""Tier types whose `stat` reads every object in a way the medium counts as a use (Redis: the
STRLEN of each key stamps its LRU clock, so a look every 512 requests would make every block
as recent as any other): the replay looks at them through `usage` (Redis: SCAN, MEMORY USAGE
and OBJECT IDLETIME, which touch nothing)."""
ENOUGH_TICKS = 30
"""Ticks of its clock the tier's eviction horizon must span for the medium's recency to stand
for the model's exact one (BENCHMARKS.md, the fleet replay against the model, measured)."""


def coarse_clock_note(result: FleetResult) -> str | None:
    """A line saying that the medium's recency clock was too coarse for this run's speed, and
    the `--pace` that would give its eviction horizon `ENOUGH_TICKS`; None when it had them."""
    ticks, horizon = result.horizon_ticks, result.horizon
    if ticks is None or horizon is None or ticks >= ENOUGH_TICKS or result.seconds <= 0:
        return None
    speed = result.trace_seconds / result.seconds  # trace seconds per second, as it ran
    at = "unpaced" if result.pace is None else f"at --pace {result.pace:g}"
    return (
        f"the shared tier's medium orders its objects by a clock of {result.recency_tick:g} s "
        f"and, {at}, the blocks it held were replaced in {horizon:.1f} s ({ticks:.0f} ticks, "
        f"fewer than {ENOUGH_TICKS}): it evicted at random among the blocks of a tick, which a "
        f"fleet whose tier turns over in minutes does not; replay slower, about --pace "
        f"{speed * ticks / ENOUGH_TICKS:.2g} (trace seconds per second)"
    )
