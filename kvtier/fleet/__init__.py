"""A fleet of engines over one shared tier: a request trace replayed through N tiering managers,
each with its own CPU primary, all writing to and reading from one store.

Each engine is a `kvtier.replay.ReplayEngine`: the real `PrimaryPool`, eviction policy and
`TieringOffloadingManager`, with its own runtime, driven through vLLM's step protocol over
synthesized blocks. The shared tier is the config's one secondary tier:

- `type: memory` stands in for a shared store at any scale (up to `MAX_ENGINES` engines): one
  in-process `MemoryTier` that every engine's manager uses, so the memory is one store's, the
  primaries' aside. Each engine sees it through existence checks (`shared.EngineTier`), as it
  sees Redis or S3: engines sharing a store learn of each other's blocks only by asking it.
- any other type is a real store (Redis, a `files` directory, S3): each engine builds its own
  tier from the config, as separate engines would, up to `MAX_SERVER_ENGINES`.

Routing (`routing`): `sticky` sends every request of a session to one engine, `random` picks
an engine per request with a seeded RNG.

Time is the trace's (`run`). Requests that arrive together (the same `timestamp`) are admitted
in the same fleet step, each on its engine, so none of them finds what another of them stores
(its blocks reach the shared tier after the step): that is how two engines come to write the
same block. An engine given several of them takes them one after another. The managers' clock
is the arrival time (their TTLs and ages run in trace time; a promotion takes none), and after
each step the runtime of every engine that stepped is let finish, one engine after another: the
figures do not depend on the machine's speed, as long as every tier call ends within its
deadline (`promotion.deadline` and `faults.timeout` stay real time: give a loaded machine or a
slow store room, as the tests and bench/fleet_replay.py do).

Measured over the second half of the requests (by index in the trace, as `kvtier.replay`): hit
tokens, found in the engine's own primary or promoted from the shared tier, and of the latter
those whose block another engine stored (cross-engine hits). Who stored each block is recorded
by the simulation (`shared.WriteLedger`), as are duplicate writes (a block written while the
store holds it from another engine), and the shared store's bytes against its capacity.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvtier.fleet.figures import EngineFigures, FleetResult
from kvtier.fleet.footprint import object_footprint, with_capacity
from kvtier.fleet.recency import RECENCY_TICK
from kvtier.fleet.routing import ROUTES, route_requests, session_of
from kvtier.fleet.run import Fleet, FleetRun
from kvtier.trace import TraceRequest, trace_keys
from tiering.config import Config
from tiering.errors import ConfigError

__all__ = [
    "MAX_ENGINES",
    "MAX_SERVER_ENGINES",
    "ROUTES",
    "EngineFigures",
    "FleetResult",
    "check_fleet",
    "replay_fleet",
    "route_requests",
    "session_of",
]

MAX_ENGINES = 256
"""Engines a fleet replay may have (the memory tier standing in for the shared store)."""
MAX_SERVER_ENGINES = 8
"""Engines a fleet replay may have on a real store (a tier and its connections each)."""


def check_fleet(config: Config, engines: int, route: str) -> None:
    """`ConfigError` unless `config` has exactly one secondary tier (the shared one), `engines`
    is from 1 to the most its type allows, and `route` is known."""
    if route not in ROUTES:
        raise ConfigError(f"--route: expected one of {', '.join(ROUTES)}, got {route!r}")
    if len(config.tiers) != 1:
        raise ConfigError(
            f"tiers: a fleet replay shares exactly one secondary tier; this config has "
            f"{len(config.tiers)}"
        )
    kind = config.tiers[0].type
    if not 1 <= engines <= MAX_ENGINES:
        raise ConfigError(f"--engines: expected 1 to {MAX_ENGINES}, got {engines}")
    if kind != "memory" and engines > MAX_SERVER_ENGINES:
        raise ConfigError(
            f"--engines {engines}: at most {MAX_SERVER_ENGINES} engines on a real store (tier "
            f"{config.tiers[0].name!r} is {kind}); a memory tier stands in for the shared "
            f"store up to {MAX_ENGINES}"
        )


def replay_fleet(
    requests: Sequence[TraceRequest],
    config: Config,
    engines: int,
    capacity: int,
    route: str = "sticky",
    seed: int = 0,
    block_bytes: int = 4096,
    progress: Callable[[int], None] | None = None,
    shared_blocks: int | None = None,
    pace: float | None = None,
) -> FleetResult:
    """Replay `requests` through `engines` managers of `capacity` primary blocks of
    `block_bytes` each, over the one secondary tier of `config`, routed by `route` with
    `seed` (module docstring). `ConfigError` as `check_fleet` says; `progress` is called with
    the number of requests done. `shared_blocks`: the shared tier holds that many blocks, its
    capacity that many times what one takes there (`kvtier.fleet.footprint`), instead of the
    config's bytes. `pace`: trace seconds replayed per wall-clock second (None: as fast as the
    engines go; `kvtier.fleet.recency` says when a medium needs it)."""
    if pace is not None and not pace > 0:
        raise ConfigError(f"--pace: expected trace seconds per second above 0, got {pace}")
    check_fleet(config, engines, route)
    one = object_footprint(config, block_bytes)
    if shared_blocks is not None:
        config = with_capacity(config, shared_blocks * one)
    tier = config.tiers[0]
    assignment = route_requests(requests, engines, route, seed)
    keys = trace_keys(requests)
    started = time.perf_counter()
    fleet = Fleet(config, engines, capacity, block_bytes, stand_in=tier.type == "memory")
    try:
        run = FleetRun(fleet, requests, keys, assignment, progress, pace)
        run.run()
        rows = run.figures()
        store = fleet.store_stat()
        counters = fleet.store_counters()
    finally:
        fleet.close()
    return FleetResult(
        engines=engines,
        route=route,
        seed=seed,
        capacity=capacity,
        block_bytes=block_bytes,
        requests=len(requests),
        tier=f"{tier.name} ({tier.type})",
        per_engine=tuple(rows),
        fleet=EngineFigures.total(rows),
        store_objects=None if store is None else store.objects,
        store_bytes=None if store is None else store.bytes_used,
        store_peak_bytes=max(run.peak, 0 if store is None else store.bytes_used),
        store_capacity=tier.capacity if store is None or store.capacity is None else store.capacity,
        store_counters=counters,
        store_error=None if store is not None else fleet.store_error,
        seconds=time.perf_counter() - started,
        object_bytes=one,
        store_held_blocks=sum(run.held) / len(run.held) if run.held else None,
        trace_seconds=run.span,
        pace=pace,
        lag=run.lag,
        recency_tick=RECENCY_TICK.get(tier.type),
    )
