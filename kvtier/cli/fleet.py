"""`kvtier replay --engines N`: a trace through a fleet of engines over one shared tier
(`kvtier.fleet`), per engine and for the fleet."""

from __future__ import annotations

import argparse

from kvtier.cli.common import emit
from kvtier.cli.progress import Progress
from kvtier.fleet import FleetResult, check_fleet, replay_fleet
from kvtier.fleet.recency import coarse_clock_note
from kvtier.trace import load_trace
from tiering.config import load_config
from tiering.errors import ConfigError

__all__ = ["run_fleet"]


def run_fleet(args: argparse.Namespace, memory: int) -> int:
    """Replay once per capacity; `memory`: the machine's bytes, which the primaries of every
    engine must fit in."""
    if args.config is None:
        raise ConfigError("--engines needs --config FILE: the config of the tier they share")
    config = load_config(args.config)  # a bad file fails before the trace is read
    check_fleet(config, args.engines, args.route)
    for capacity in args.capacity:
        need = args.engines * capacity * args.block_bytes
        if need > memory:
            raise ConfigError(
                f"--engines {args.engines} x --capacity {capacity:,} x --block-bytes "
                f"{args.block_bytes:,}: {need:,} bytes of primary memory; this machine has "
                f"{memory:,}"
            )
    trace = load_trace(args.trace)
    requests = trace.requests[: args.requests] if args.requests else trace.requests
    results = []
    for capacity in args.capacity:
        label = f"{args.engines} engines ({args.route}) @ {capacity:,} blocks each"
        progress = Progress.of(args, len(requests), label)
        results.append(
            replay_fleet(
                requests,
                config,
                args.engines,
                capacity,
                args.route,
                args.seed,
                args.block_bytes,
                progress.update,
                args.shared_blocks,
                args.pace,
            )
        )
        progress.close()
    data = {
        "trace": str(trace.path),
        "config": str(args.config),
        "requests": len(requests),
        "results": [r.as_dict() for r in results],
    }
    head = (
        f"trace {trace.path} ({len(requests):,} requests) through {args.config}: "
        f"{args.engines} engine(s), route {args.route} (seed {args.seed}); rates over the "
        f"last {results[0].fleet.measured_requests:,} requests"
    )
    lines = [head]
    for result in results:
        lines += ["", *_lines(result)]
    return emit(args, data, lines)


def _lines(r: FleetResult) -> list[str]:
    rows: list[tuple[str, ...]] = [
        (
            "engine",
            "requests",
            "hit rate",
            "primary",
            "shared",
            "cross-engine",
            "writes",
            "duplicates",
        )
    ]
    for row in (*r.per_engine, r.fleet):
        rows.append(
            (
                "fleet" if row.engine < 0 else str(row.engine),
                f"{row.requests:,}",
                _pct(row.hit_rate),
                _pct(row.primary_hit_rate),
                _pct(row.shared_hit_rate),
                _pct(row.cross_share),
                f"{row.writes:,}",
                f"{row.duplicate_writes:,}",
            )
        )
    capacity = "unbounded" if r.store_capacity is None else f"{r.store_capacity:,}"
    if r.capacity_blocks is not None:
        capacity += f" ({r.capacity_blocks:,} blocks of {r.object_bytes:,} bytes there)"
    share = f" ({100 * r.store_peak_bytes / r.store_capacity:.1f}%)" if r.store_capacity else ""
    evictions = r.evictions
    if r.store_bytes is None or r.store_objects is None:
        held = f"not readable at the end ({r.store_error})"
    else:
        held = f"{r.store_bytes:,} bytes in {r.store_objects:,} objects at the end"
        if r.capacity_blocks:
            held += f" ({100 * r.store_objects / r.capacity_blocks:.1f}% of its blocks)"
        if r.store_held_blocks is not None:
            held += f", {r.store_held_blocks:,.0f} blocks on average over the measured half"
    store = f"shared tier {r.tier}: {held}, at most {r.store_peak_bytes:,}{share} of {capacity}" + (
        "" if evictions is None else f"; {evictions:,} evictions"
    )
    unsettled = r.fleet.unsettled_requests
    notes = [f"{unsettled:,} request(s) never settled (their leading hits were used)"] * bool(
        unsettled
    )
    if r.breakers_opened:
        notes.append(
            f"the shared tier's breaker opened on {r.breakers_opened:,} engine(s): their jobs "
            "were refused for a while (misses)"
        )
    if r.pace is not None:
        notes.append(
            f"paced at {r.pace:g} trace seconds per second ({r.trace_seconds:,.0f} s of trace "
            f"in {r.seconds:,.0f} s; an arrival at most {r.lag:.1f} s late)"
        )
    if r.horizon_ticks is not None:
        notes.append(
            f"the shared tier's blocks were replaced in {r.horizon:,.1f} s: "
            f"{r.horizon_ticks:,.0f} ticks of its medium's {r.recency_tick:g} s recency clock"
        )
    if r.sweep_order is not None:
        notes.append(f"the shared tier's sweeper removed objects {_ORDERS[r.sweep_order]}")
    coarse = coarse_clock_note(r)
    if coarse is not None:
        notes.append(coarse)
    return [
        f"primary {r.capacity:,} blocks of {r.block_bytes:,} bytes per engine ({r.seconds:.1f}s)",
        *_aligned(rows),
        store,
        "cross-engine: of the hits on the shared tier, the share another engine stored; "
        "duplicates: blocks written while the shared tier held them from another engine",
        *notes,
    ]


_ORDERS = {
    "by use": "by use (live engines' manifests of use)",
    "write order": "by write order (LastModified, oldest first): no live engine's manifest of "
    "use named them (engines write one only with primary.warm_start)",
    "mixed": "by use in some passes, by write order in others (a manifest of use lapsed)",
}


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """The first column left, the numbers right."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.rjust(w) if i else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]


def _pct(rate: float) -> str:
    return f"{100 * rate:.2f}%"
