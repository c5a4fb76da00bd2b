"""`kvtier replay`: a request trace through the real primary pool, hit rate per policy; with
`--config`, through the tiering manager and tiers; with `--engines`, through a fleet
(`kvtier.cli.fleet`)."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from kvtier.cli import args as argtypes
from kvtier.cli.common import JSON
from kvtier.cli.fleet import run_fleet
from kvtier.cli.progress import Progress
from kvtier.fleet import MAX_ENGINES, MAX_SERVER_ENGINES, ROUTES
from kvtier.replay import ReplayResult, replay, replay_tiered
from kvtier.trace import load_trace
from tiering.config import load_config
from tiering.errors import ConfigError
from tiering.policies import get_policy_class
from tiering.tier.format import MAX_BLOCK_BYTES

__all__ = ["add_parser", "run"]


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "replay",
        parents=[JSON],
        help="replay a request trace through the primary pool and print the prefix hit rate",
        description=(
            "Replay a JSONL request trace (Mooncake format: input_length, hash_ids of 512-token "
            "prefix blocks) through the real primary pool, and print the token-weighted prefix "
            "hit rate over the second half of the requests."
        ),
    )
    parser.add_argument(
        "trace", metavar="TRACE", type=argtypes.path, help="JSONL trace file, optionally .gz"
    )
    parser.add_argument(
        "--capacity",
        required=True,
        type=_int_list,
        metavar="N[,N...]",
        help="primary capacity in blocks; several, comma-separated, replay once each",
    )
    parser.add_argument(
        "--policy",
        default=["lru", "arc"],
        type=_name_list,
        metavar="P[,P...]",
        help="eviction policies to replay (default: lru,arc)",
    )
    parser.add_argument(
        "--config",
        type=argtypes.path,
        help="replay through the tiering manager and the tiers of this kvtier config (bytes "
        "really written and read); the policy comes from its primary.eviction. Persistent "
        "tiers keep the replay's blocks: start each run on an empty directory or prefix",
    )
    parser.add_argument(
        "--block-bytes",
        type=argtypes.count(1, MAX_BLOCK_BYTES),
        help="with --config: bytes of each synthesized block (default 4096; with --engines, "
        f"{FLEET_BLOCK_BYTES}, N primaries stay small). Hit rates depend on the blocks a tier "
        "holds, not on their bytes: give a shared tier's capacity in blocks with --shared-blocks",
    )
    parser.add_argument(
        "--shared-blocks",
        type=argtypes.count(1, MAX_CAPACITY),
        metavar="N",
        help="with --engines: the shared tier holds N blocks, its capacity N times what one "
        "synthesized block takes on its medium (a files directory's alignment included), "
        "instead of the config's capacity in bytes",
    )
    parser.add_argument(
        "--requests", type=argtypes.count(1, 10**9), help="replay only the first N requests"
    )
    parser.add_argument(
        "--pace",
        type=argtypes.rate(1e9),
        metavar="X",
        help="with --engines: replay X seconds of the trace's timestamps per wall-clock second "
        "(default: as fast as the engines go). A medium that evicts by itself orders its "
        "objects by a coarse clock (Redis's LRU clock and S3's LastModified: 1 s): unpaced, "
        "its tier turns over within a few ticks, and it evicts at random among the blocks of "
        "a tick; the replay says when, and the pace that gives it enough",
    )
    parser.add_argument(
        "--engines",
        type=argtypes.count(1, MAX_ENGINES),
        metavar="N",
        help="with --config: replay through N engines, each with its own primary of --capacity "
        "blocks, over the config's one tier, shared (a memory tier stands in for a shared "
        f"store up to {MAX_ENGINES} engines; a real one, Redis or a directory, up to "
        f"{MAX_SERVER_ENGINES})",
    )
    parser.add_argument(
        "--route",
        choices=ROUTES,
        help="with --engines: 'sticky' sends each session (a request's first two blocks) to one "
        "engine, 'random' picks an engine per request (default: sticky)",
    )
    parser.add_argument(
        "--seed",
        type=argtypes.count(0, 2**63 - 1),
        help="with --engines: the seed of the routing (default 0)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    fleet = args.engines is not None
    if args.block_bytes is None:
        args.block_bytes = FLEET_BLOCK_BYTES if fleet else 4096
    if fleet:
        args.route = "sticky" if args.route is None else args.route
        args.seed = 0 if args.seed is None else args.seed
        return run_fleet(args, physical_memory())
    if any(x is not None for x in (args.route, args.seed, args.shared_blocks, args.pace)):
        raise ConfigError("--route, --seed, --shared-blocks and --pace need --engines N")
    if args.config is not None:
        return run_tiered(args)
    for name in args.policy:
        get_policy_class(name)  # an unknown name fails before minutes of replay
    trace = load_trace(args.trace)
    rows = []
    for policy in args.policy:
        for capacity in args.capacity:
            progress = Progress.of(args, len(trace.requests), f"{policy} @ {capacity:,} blocks")
            start = time.perf_counter()
            result = replay(trace.requests, capacity, policy, progress.update)
            elapsed = time.perf_counter() - start
            progress.close()
            rows.append((result, trace.reference_hit_rate(policy, capacity), elapsed))
    if args.json:
        print(json.dumps(_as_json(str(trace.path), trace.sha256, rows), indent=2))
    else:
        _print_table(str(trace.path), rows)
    return 0


def _as_json(
    path: str, sha256: str, rows: list[tuple[ReplayResult, float | None, float]]
) -> dict[str, Any]:
    return {
        "trace": path,
        "trace_sha256": sha256,
        "results": [
            {
                "policy": r.policy,
                "capacity_blocks": r.capacity,
                "hit_rate": r.hit_rate,
                "reference_hit_rate": None if ref is None else ref / 100,
                "hit_tokens": r.hit_tokens,
                "total_tokens": r.total_tokens,
                "requests": r.requests,
                "measured_requests": r.measured_requests,
                "block_refs": r.block_refs,
                "evictions": r.evictions,
                "unstored_blocks": r.unstored_blocks,
                "seconds": round(elapsed, 3),
            }
            for r, ref, elapsed in rows
        ],
    }


def _print_table(path: str, rows: list[tuple[ReplayResult, float | None, float]]) -> None:
    first = rows[0][0]
    print(
        f"trace {path}: {first.requests:,} requests, {first.block_refs:,} block references; "
        f"hit rate over the last {first.measured_requests:,} requests"
    )
    header = ("policy", "capacity", "hit rate", "reference", "hit tokens", "evictions", "time")
    table = [header]
    for r, ref, elapsed in rows:
        table.append(
            (
                r.policy,
                f"{r.capacity:,}",
                f"{100 * r.hit_rate:.2f}%",
                "-" if ref is None else f"{ref:.1f}%",
                f"{r.hit_tokens:,}",
                f"{r.evictions:,}",
                f"{elapsed:.1f}s",
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print(
            "  ".join(
                cell.rjust(w) if i else cell.ljust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    if any(r.unstored_blocks for r, _, _ in rows):
        print(
            "note: some requests are longer than the capacity; their extra blocks were not stored"
        )


def run_tiered(args: argparse.Namespace) -> int:
    config = load_config(args.config)  # a bad file fails before the trace is read
    memory = physical_memory()
    for capacity in args.capacity:
        if capacity * args.block_bytes > memory:
            raise ConfigError(
                f"--capacity {capacity:,} x --block-bytes {args.block_bytes:,}: "
                f"{capacity * args.block_bytes:,} bytes of primary memory; this machine has "
                f"{memory:,}"
            )
    trace = load_trace(args.trace)
    requests = trace.requests[: args.requests] if args.requests else trace.requests
    rows = []
    for capacity in args.capacity:
        progress = Progress.of(args, len(requests), f"{args.config.name} @ {capacity:,} blocks")
        result = replay_tiered(requests, config, capacity, args.block_bytes, progress.update)
        progress.close()
        rows.append(result)
    if args.json:
        print(
            json.dumps(
                {
                    "trace": str(trace.path),
                    "config": str(args.config),
                    "requests": len(requests),
                    "results": [
                        {
                            "capacity_blocks": r.capacity,
                            "block_bytes": r.block_bytes,
                            "hit_rate": r.hit_rate,
                            "tier_hit_rates": {
                                t: n / r.total_tokens if r.total_tokens else 0.0
                                for t, n in r.tier_hit_tokens.items()
                            },
                            "manager_us_per_block": r.us_per_block,
                            "stats": {
                                "manager": r.stats["manager"],
                                "tiers": {
                                    t: {k: v for k, v in f.items() if k != "latencies"}
                                    for t, f in r.stats["tiers"].items()
                                },
                            },
                        }
                        for r in rows
                    ],
                },
                indent=2,
                default=str,
            )
        )
        return 0
    print(f"trace {trace.path} ({len(requests):,} requests) through {args.config}")
    for r in rows:
        tiers = ", ".join(
            f"{t} {100 * n / max(r.total_tokens, 1):.2f}%" for t, n in r.tier_hit_tokens.items()
        )
        print(
            f"capacity {r.capacity:,} blocks: hit rate {100 * r.hit_rate:.2f}% "
            f"(from tiers: {tiers or 'none'}); manager {r.us_per_block:.1f} us per block"
        )
    return 0


FLEET_BLOCK_BYTES = 64
"""Bytes of each synthesized block of a fleet replay unless `--block-bytes` says."""

MAX_CAPACITY = 10_000_000
"""Blocks a replayed primary may have (a list entry each; far more than a trace holds)."""


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part.replace("_", "")) for part in text.split(",") if len(part) <= 20]
    except ValueError:
        values = []
    if len(values) != len(text.split(",")):
        raise argparse.ArgumentTypeError(
            f"expected positive integers separated by commas, got {text!r}"
        )
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"capacities must be positive, got {text!r}")
    if any(v > MAX_CAPACITY for v in values):
        raise argparse.ArgumentTypeError(
            f"capacities must be at most {MAX_CAPACITY:,} blocks, got {text!r}"
        )
    return values


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # not a POSIX system that says
        return 2**62


def _name_list(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected names like 'lru,arc', got {text!r}")
    return names
