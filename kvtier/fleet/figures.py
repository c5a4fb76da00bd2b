"""What a fleet replay measured: each engine's figures, the fleet's, and the shared store's."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["COUNTED", "EngineFigures", "FleetResult"]

COUNTED = (
    "requests",
    "measured_requests",
    "hit_tokens",
    "total_tokens",
    "shared_hit_tokens",
    "cross_hit_tokens",
    "shared_hit_blocks",
    "cross_hit_blocks",
    "unsettled_requests",
)
"""The counts a replay keeps per engine (`EngineFigures.of`)."""


@dataclass(frozen=True, slots=True)
class EngineFigures:
    """Any thread (a frozen value): one engine's share of a fleet replay, or the fleet's sum
    (`engine` -1). Tokens and hit blocks are over the measured half (the second half of the
    requests, by their index in the trace); writes over the whole replay."""

    engine: int
    requests: int
    measured_requests: int
    hit_tokens: int
    """From the engine's own primary or promoted from the shared tier."""
    total_tokens: int
    shared_hit_tokens: int
    """Of `hit_tokens`, those of blocks promoted from the shared tier."""
    cross_hit_tokens: int
    """Of `shared_hit_tokens`, those of blocks another engine stored."""
    shared_hit_blocks: int
    cross_hit_blocks: int
    writes: int
    """Blocks written to the shared tier."""
    duplicate_writes: int
    """Of `writes`, blocks the shared tier held from another engine already."""
    duplicate_bytes: int
    unsettled_requests: int
    """Requests still deferred after the most steps a replay allows (their leading hits were
    used)."""
    tier: Mapping[str, Any] = field(default_factory=dict)
    """The manager's figures of the shared tier (lookups, promotions, demotions, skipped
    demotions, ...); empty for the fleet's sum."""

    @classmethod
    def of(
        cls,
        engine: int,
        counts: Mapping[str, int],
        writes: int,
        duplicates: int,
        duplicate_bytes: int,
        tier: Mapping[str, Any] | None = None,
    ) -> EngineFigures:
        return cls(
            engine=engine,
            requests=counts.get("requests", 0),
            measured_requests=counts.get("measured_requests", 0),
            hit_tokens=counts.get("hit_tokens", 0),
            total_tokens=counts.get("total_tokens", 0),
            shared_hit_tokens=counts.get("shared_hit_tokens", 0),
            cross_hit_tokens=counts.get("cross_hit_tokens", 0),
            shared_hit_blocks=counts.get("shared_hit_blocks", 0),
            cross_hit_blocks=counts.get("cross_hit_blocks", 0),
            writes=writes,
            duplicate_writes=duplicates,
            duplicate_bytes=duplicate_bytes,
            unsettled_requests=counts.get("unsettled_requests", 0),
            tier=dict(tier or {}),
        )

    @classmethod
    def total(cls, rows: list[EngineFigures]) -> EngineFigures:
        """The fleet's sum of `rows`."""
        counts: Counter[str] = Counter()
        for row in rows:
            counts.update({name: getattr(row, name) for name in COUNTED})
        return cls.of(
            -1,
            counts,
            sum(r.writes for r in rows),
            sum(r.duplicate_writes for r in rows),
            sum(r.duplicate_bytes for r in rows),
        )

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.total_tokens if self.total_tokens else 0.0

    @property
    def primary_hit_rate(self) -> float:
        """Hit tokens found in the engine's own primary, over all tokens."""
        own = self.hit_tokens - self.shared_hit_tokens
        return own / self.total_tokens if self.total_tokens else 0.0

    @property
    def shared_hit_rate(self) -> float:
        """Hit tokens promoted from the shared tier, over all tokens."""
        return self.shared_hit_tokens / self.total_tokens if self.total_tokens else 0.0

    @property
    def cross_share(self) -> float:
        """Of the hit tokens promoted from the shared tier, the share another engine stored."""
        return self.cross_hit_tokens / self.shared_hit_tokens if self.shared_hit_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Plain numbers, the rates included (for `--json`)."""
        out = asdict(self)
        out["tier"] = dict(self.tier)
        if not out["tier"]:
            del out["tier"]
        for rate in ("hit_rate", "primary_hit_rate", "shared_hit_rate", "cross_share"):
            out[rate] = getattr(self, rate)
        return out


@dataclass(frozen=True, slots=True)
class FleetResult:
    """Any thread (a frozen value): the outcome of a fleet replay."""

    engines: int
    route: str
    seed: int
    capacity: int
    """Primary blocks of each engine."""
    block_bytes: int
    requests: int
    tier: str
    """The shared tier's name and type, as `name (type)`."""
    per_engine: tuple[EngineFigures, ...]
    fleet: EngineFigures
    store_objects: int | None
    store_bytes: int | None
    """What the shared store holds once the requests are done (before the engines stop); None
    when it could not say (`store_error`)."""
    store_peak_bytes: int
    """The most it held at any look (`kvtier.fleet.run.STORE_SAMPLE`, and at the end)."""
    store_capacity: int | None
    """The shared tier's `capacity` (None: unbounded)."""
    store_counters: Mapping[str, int]
    """The store's own events (the memory tier's evictions), over its instances."""
    store_error: str | None
    """Why the store could not say what it holds at the end (None: it did)."""
    seconds: float
    object_bytes: int = 0
    """What one synthesized block takes in the shared tier (`kvtier.fleet.footprint`)."""
    store_held_blocks: float | None = None
    """The blocks the shared tier held on average at its looks in the measured half (None: no
    look there): what it really holds, which a medium that keeps room free (a `files`
    directory's sweep margin and writers' room in flight) makes less than `capacity_blocks`."""
    trace_seconds: float = 0.0
    """The trace's time from the first arrival to the last (its timestamps)."""
    pace: float | None = None
    """Trace seconds replayed per wall-clock second (None: unpaced, as fast as it goes)."""
    lag: float = 0.0
    """With `pace`: the most seconds an arrival came after its due time."""
    recency_tick: float | None = None
    """The resolution, in seconds, of the clock by which the medium itself orders its objects
    for eviction (`kvtier.fleet.recency`; None: exact, or kvtier evicts)."""

    @property
    def horizon(self) -> float | None:
        """Wall-clock seconds in which the writes replaced the blocks the shared tier held (its
        eviction horizon: a block older than that is gone unless used); None without a look or a
        write."""
        stored = self.fleet.writes - self.fleet.duplicate_writes
        if self.store_held_blocks is None or stored <= 0 or self.seconds <= 0:
            return None
        return self.store_held_blocks * self.seconds / stored

    @property
    def horizon_ticks(self) -> float | None:
        """`horizon` in ticks of the medium's recency clock (None: an exact clock, or no
        horizon)."""
        horizon = self.horizon
        if horizon is None or not self.recency_tick:
            return None
        return horizon / self.recency_tick

    @property
    def capacity_blocks(self) -> int | None:
        """The shared tier's capacity in synthesized blocks (None: unbounded)."""
        if self.store_capacity is None or not self.object_bytes:
            return None
        return self.store_capacity // self.object_bytes

    @property
    def hit_rate(self) -> float:
        return self.fleet.hit_rate

    @property
    def evictions(self) -> int | None:
        """Objects the shared tier removed to stay within its capacity, as its instances count
        them (`evictions`; an S3 prefix's sweeper: `swept`); None: none counted by kvtier (a
        Redis server evicts by itself)."""
        for name in ("evictions", "swept"):
            if name in self.store_counters:
                return self.store_counters[name]
        return None

    @property
    def sweep_order(self) -> str | None:
        """The order an S3 sweeper followed in the passes that removed objects (`tiers.s3.use`):
        "by use" (live manifests of use or records of reads), "write order" (neither:
        LastModified, oldest first), or "mixed"; None: no such pass."""
        by_use = self.store_counters.get("sweeps_by_use", 0)
        written = self.store_counters.get("sweeps_write_order", 0)
        if not by_use and not written:
            return None
        return "mixed" if by_use and written else "by use" if by_use else "write order"

    @property
    def breakers_opened(self) -> int:
        """Engines whose breaker of the shared tier opened (their jobs refused for a while:
        misses)."""
        return sum(1 for row in self.per_engine if row.tier.get("breaker_opened"))

    def as_dict(self) -> dict[str, Any]:
        """Plain numbers (for `--json`)."""
        return {
            "engines": self.engines,
            "route": self.route,
            "seed": self.seed,
            "capacity_blocks": self.capacity,
            "block_bytes": self.block_bytes,
            "requests": self.requests,
            "shared_tier": {
                "tier": self.tier,
                "objects": self.store_objects,
                "bytes_used": self.store_bytes,
                "peak_bytes": self.store_peak_bytes,
                "capacity": self.store_capacity,
                "capacity_blocks": self.capacity_blocks,
                "object_bytes": self.object_bytes,
                "held_blocks": self.store_held_blocks,
                "recency_tick": self.recency_tick,
                "horizon": None if self.horizon is None else round(self.horizon, 3),
                "horizon_ticks": (
                    None if self.horizon_ticks is None else round(self.horizon_ticks, 1)
                ),
                "evictions": self.evictions,
                "sweep_order": self.sweep_order,
                "counters": dict(self.store_counters),
                "error": self.store_error,
            },
            "fleet": self.fleet.as_dict(),
            "per_engine": [row.as_dict() for row in self.per_engine],
            "breakers_opened": self.breakers_opened,
            "seconds": round(self.seconds, 3),
            "trace_seconds": self.trace_seconds,
            "pace": self.pace,
            "lag": round(self.lag, 3),
        }
