"""`kvtier replay --engines N` on a real shared store (issue 44, item 2): a redis-server
(`--medium redis`) or SeaweedFS's S3 gateway (`--medium s3`) started here, the shared tier sized
for `--shared-blocks` synthesized blocks as the medium counts them, then the replay.

Redis: `maxmemory` sized for the blocks and policy `allkeys-lru` (what an operator bounding a
shared Redis sets: the server evicts, kvtier cannot).

Sizing: Redis counts its clients' buffers against `maxmemory`, and the replay's 8 engines
keep over a hundred connections whose pipelines of write-through batches peak at megabytes,
as much as 13,107 64-byte blocks take: sized for the blocks alone the server evicts most of
them at each peak. So `maxmemory` = the server's own `used_memory` (less its clients') + the
blocks x what one adds (2,000 scratch blocks put through `--engines` Redis tiers, measured
and flushed: key, value and Redis's per-key overhead) + the clients' peak memory in a first,
unbounded pass over the first 1,500 requests (what an operator gives a shared Redis as
headroom for its clients). Between peaks the server holds more blocks than asked: the replay's
`held_blocks` says how many.

Redis's eviction is by use as far as two of its settings allow: its LRU clock ticks once a
second, so `--pace` must let the tier's eviction horizon span tens of seconds (the output's
`horizon_ticks`; `kvtier.fleet.recency`), and its sampled LRU matches an exact one here only with
`--samples 64` (BENCHMARKS.md).

S3: the tier's `capacity` is `--shared-blocks` times one block's object (`--shared-blocks` of
`kvtier replay`: the object's length, which is what the sweeper counts; one object a block,
`blocks_per_object` 1, so no pack rounds a block's share), swept every `--sweep-interval` by
the one elected sweeper, least recently used first as far as the engines tell it: each
engine's tier writes the keys it read (its record of reads, `tiers.s3.reads`) every `--reads`
seconds (the tier's `reads_interval`; 0: none, then write order, `sweeps_write_order`); with
`--manifests S` each engine (an identity of its own) also writes its manifest of use every S
seconds of wall-clock time, and the sweeper removes first what no live manifest names.
`write_once` as configured (default: a block another engine wrote is not written again, and
keeps its first write's LastModified; `--rewrite`: every write-through rewrites it). The
prefix holds its capacity plus what was written since the last pass listed it, so `held_blocks`
is above `--shared-blocks`; LastModified has whole seconds, so `--pace` must let the horizon
span tens of them (`horizon_ticks`), and the sweep interval be small against it.

    python bench/fleet_media.py TRACE [--medium redis|s3] [--requests 6000] [--engines 8]
                                [--capacity 1638] [--shared-blocks 13107] [--pace X] [--json]
                                redis: [--samples 5] [--headroom 1] [--follow-clients]
                                s3: [--sweep-interval 1] [--rewrite] [--manifests S]
                                    [--reads S]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from kvtier.fleet import FleetResult, replay_fleet  # noqa: E402
from kvtier.replay import REPLAY_NAMESPACE  # noqa: E402
from kvtier.servers import RedisServer, SeaweedS3  # noqa: E402
from kvtier.trace import load_trace  # noqa: E402
from tiering.config import parse_config, tier_from_config  # noqa: E402
from tiering.keys import make_key  # noqa: E402

SCRATCH = 2000
PROBE = 1500
"""Requests of a first, unbounded pass that measures the replay's clients' peak memory."""
T = TypeVar("T")


def fleet_config(tier: dict[str, object], primary: dict[str, object] | None = None) -> object:
    """The replay's config: LRU primaries, `tier` shared and written through, deadlines with
    room for a loaded machine."""
    return parse_config(
        {
            "primary": {"eviction": "lru", **(primary or {})},
            "promotion": {"gate": "always", "deadline": "10s"},
            "faults": {"timeout": "10s"},
            "tiers": [{"name": "shared", "write": "through", **tier}],
        }
    )


def config(url: str) -> object:
    return fleet_config({"type": "redis", "url": url})


async def sized(cfg: object, engines: int, block_bytes: int, client: redis.Redis) -> tuple:
    """(the server's used_memory with nothing stored, less its clients', bytes per block): the
    tiers each put their share of `SCRATCH` blocks, the server is measured, flushed and
    measured again."""
    entry = cfg.tiers[0]  # type: ignore[attr-defined]
    tiers = [tier_from_config(entry, REPLAY_NAMESPACE, cfg) for _ in range(engines)]
    for tier in tiers:
        await tier.__aenter__()
    try:
        for i in range(SCRATCH):
            key = make_key(hashlib.sha256(b"scratch%d" % i).digest())
            await tiers[i % engines].put(key, bytes(block_bytes))
        full = int(client.info("memory")["used_memory"])
        client.flushall()
        memory = client.info("memory")
        empty = int(memory["used_memory"])
    finally:
        for tier in tiers:
            await tier.__aexit__(None, None, None)
    return empty - int(memory["mem_clients_normal"]), (full - empty) / SCRATCH


def watched(port: int, run: Callable[[], T], follow: int | None = None) -> tuple[T, dict[str, int]]:
    """`run()` and the peaks of the server's client memory and connections meanwhile (looked
    at every 50 ms; every 10 ms with `follow`, when `maxmemory` is set each time to `follow`
    plus the clients' memory then: the clients counted out, as far as a look can)."""
    peak = {"mem_clients_normal": 0, "connected_clients": 0}
    done = threading.Event()

    def sample() -> None:
        watch = redis.Redis(host="127.0.0.1", port=port)
        while not done.wait(0.05 if follow is None else 0.01):
            memory, clients = watch.info("memory"), watch.info("clients")
            if follow is not None:
                watch.config_set("maxmemory", follow + int(memory["mem_clients_normal"]))
            peak["mem_clients_normal"] = max(
                peak["mem_clients_normal"], int(memory["mem_clients_normal"])
            )
            peak["connected_clients"] = max(
                peak["connected_clients"], int(clients["connected_clients"])
            )

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        return run(), peak
    finally:
        done.set()
        sampler.join()


class Progress:
    """A line on stderr every `EVERY` requests done (a run takes minutes)."""

    EVERY = 500

    def __init__(self) -> None:
        self.next = self.EVERY

    def __call__(self, done: int) -> None:
        if done >= self.next:
            self.next = done - done % self.EVERY + self.EVERY
            print(f"{time.strftime('%H:%M:%S')} {done} requests", file=sys.stderr, flush=True)


def figures(result: FleetResult, requests: int) -> dict[str, object]:
    """What every medium's run reports."""
    return {
        "requests": requests,
        "hit_rate": round(100 * result.hit_rate, 2),
        "held_blocks": result.store_held_blocks,
        "objects_at_end": result.store_objects,
        "store_error": result.store_error,
        "seconds": round(result.seconds, 1),
        "pace": result.pace,
        "lag": round(result.lag, 1),
        "horizon": None if result.horizon is None else round(result.horizon, 1),
        "horizon_ticks": result.horizon_ticks and round(result.horizon_ticks),
    }


def on_redis(args: argparse.Namespace, requests: list, work: Path) -> dict[str, object]:
    """The replay over a redis-server with `allkeys-lru` (module docstring)."""
    server = RedisServer(work)
    server.start()
    try:
        client = redis.Redis(host="127.0.0.1", port=server.port)
        cfg = config(server.url)
        base, one = asyncio.run(sized(cfg, args.engines, args.block_bytes, client))
        probe = requests[: min(len(requests), PROBE)]
        _, probed = watched(
            server.port,
            lambda: replay_fleet(
                probe, cfg, args.engines, args.capacity, "random", 0, args.block_bytes
            ),
        )
        client.flushall()
        clients = probed["mem_clients_normal"]
        maxmemory = (
            int(base + args.shared_blocks * one + args.headroom * clients)
            if args.shared_blocks
            else 0
        )
        client.config_set("maxmemory", maxmemory)
        client.config_set("maxmemory-policy", "allkeys-lru")
        client.config_set("maxmemory-samples", args.samples)
        follow = int(base + args.shared_blocks * one) if args.follow_clients else None
        result, peak = watched(
            server.port,
            lambda: replay_fleet(
                requests,
                cfg,
                args.engines,
                args.capacity,
                "random",
                0,
                args.block_bytes,
                Progress(),
                pace=args.pace,
            ),
            follow,
        )
        return {
            "probe_clients": clients,
            **peak,
            "per_block": round(one, 1),
            "baseline": base,
            "maxmemory": maxmemory,
            "samples": args.samples,
            "follow_clients": args.follow_clients,
            **figures(result, len(requests)),
            "dbsize": client.dbsize(),
            "evicted_keys": int(client.info("stats")["evicted_keys"]),
        }
    finally:
        server.stop()


def s3_config(
    server: SeaweedS3,
    sweep_interval: float,
    write_once: bool,
    manifests: float | None = None,
    block_bytes: int = 64,
    reads: float | None = None,
) -> object:
    """`manifests`: the engines write manifests of use every so many seconds (a warm start of
    one block of `block_bytes`: the recorder runs with a warm start), which the sweeper orders
    by; `reads`: the tiers' `reads_interval` (None: the tier's default)."""
    primary = (
        {}
        if manifests is None
        else {
            "warm_start": block_bytes,
            "warm_manifest_interval": manifests,
        }
    )
    tier = {
        "type": "s3",
        "bucket": server.bucket,
        "prefix": "fleet/",
        "endpoint_url": server.endpoint,
        "access_key": server.ACCESS_KEY,
        "secret_key": server.SECRET_KEY,
        "sweep_interval": sweep_interval,
        "write_once": write_once,
    }
    if reads is not None:
        tier["reads_interval"] = reads
    return fleet_config(tier, primary)


SWEEP_COUNTERS = (
    "sweeps",
    "sweeps_write_order",
    "sweeps_by_use",
    "sweep_errors",
    "reads_records_written",
    "reads_record_failures",
    "use_reads_refused",
)


def on_s3(args: argparse.Namespace, requests: list, work: Path) -> dict[str, object]:
    """The replay over SeaweedFS's S3 gateway, its prefix swept to `--shared-blocks` blocks
    (module docstring)."""
    server = SeaweedS3(work / "seaweedfs")
    server.start()
    try:
        cfg = s3_config(
            server,
            args.sweep_interval,
            not args.rewrite,
            args.manifests,
            args.block_bytes,
            args.reads,
        )
        result = replay_fleet(
            requests,
            cfg,  # type: ignore[arg-type]
            args.engines,
            args.capacity,
            "random",
            0,
            args.block_bytes,
            progress=Progress(),
            shared_blocks=args.shared_blocks or None,
            pace=args.pace,
        )
        counters = result.store_counters
        return {
            "object_bytes": result.object_bytes,
            "capacity": result.store_capacity,
            "sweep_interval": args.sweep_interval,
            "write_once": not args.rewrite,
            "manifests": args.manifests,
            "reads_interval": args.reads,
            **figures(result, len(requests)),
            "duplicate_writes": result.fleet.duplicate_writes,
            "evictions": result.evictions,
            "sweep_order": result.sweep_order,
            **{k: counters.get(k, 0) for k in SWEEP_COUNTERS},
        }
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--medium", choices=("redis", "s3"), default="redis")
    parser.add_argument("--requests", type=int)
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--capacity", type=int, default=1638)
    parser.add_argument("--shared-blocks", type=int, default=13107)
    parser.add_argument("--block-bytes", type=int, default=64)
    parser.add_argument("--samples", type=int, default=5, help="redis: maxmemory-samples")
    parser.add_argument(
        "--headroom", type=float, default=1.0, help="redis: times the clients' peak memory given"
    )
    parser.add_argument(
        "--follow-clients",
        action="store_true",
        help="redis: set maxmemory every 10 ms to the blocks' share plus the clients' memory then",
    )
    parser.add_argument(
        "--sweep-interval", type=float, default=1.0, help="s3: the sweeper's sweep_interval"
    )
    parser.add_argument(
        "--rewrite", action="store_true", help="s3: write_once false (every write rewrites)"
    )
    parser.add_argument(
        "--manifests",
        type=float,
        help="s3: the engines write manifests of use every so many seconds (a one-block warm "
        "start), and the sweeper orders by them (default: none, write order)",
    )
    parser.add_argument(
        "--reads",
        type=float,
        help="s3: the tiers' reads_interval, how often each engine writes the keys it read "
        "(default: the tier's, 30 s; 0: none, so write order unless --manifests)",
    )
    parser.add_argument(
        "--pace",
        type=float,
        help="trace seconds replayed per wall-clock second (default: unpaced); Redis's LRU "
        "clock ticks once a second, S3's LastModified has whole seconds "
        "(kvtier.fleet.recency)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    # A SIGTERM (a run stopped by hand, a timeout) ends it as an exception would: the server
    # it started is stopped and its directory removed, not left running.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    requests = load_trace(args.trace).requests[: args.requests]
    run = on_s3 if args.medium == "s3" else on_redis
    with tempfile.TemporaryDirectory(prefix="kvtier-fleet-media-") as work:
        out = {"medium": args.medium, **run(args, requests, Path(work))}
    print(json.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
