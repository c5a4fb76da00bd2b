"""A fleet on the shared trace: hit rate against the number of engines and the routing, against
the ceiling of one engine holding every primary, in one run.

Each row is `kvtier replay --engines N --route R` (kvtier/fleet/): N tiering managers with a
primary of `--capacity` blocks each, over one shared memory tier (the stand-in for a shared
store) of `--shared-blocks` blocks, written through. Its ceiling is one manager whose primary
holds N times one engine's (every primary pooled), over the same shared tier: what the fleet
would find if every engine saw every block the others hold in their primaries. The ratio
fleet / ceiling is what splitting the primary over N engines costs, with this routing.

Each ceiling is replayed once per N (routing does not apply to one engine); N = 1 is its own
ceiling. The replays are deterministic (trace time, no wall-clock effects): the hit rates do
not change from run to run; the seconds do.

    python bench/fleet_replay.py [--engines 1,2,4,8,16,64,256] [--routes sticky,random]
                                 [--capacity 1638] [--shared-blocks 6553] [--block-bytes 256]
                                 [--requests N] [--seed 0] [--jobs 2] [--trace FILE] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import hashlib
import json
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvtier.fleet import replay_fleet  # noqa: E402
from kvtier.replay import REPLAY_NAMESPACE  # noqa: E402
from kvtier.trace import load_trace  # noqa: E402
from tiering.config import parse_config  # noqa: E402
from tiering.keys import make_key  # noqa: E402
from tiers.memory import MemoryTier  # noqa: E402

SHARED_TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
SHIPPED_TRACE = ROOT / "bench" / "traces" / "mooncake_conversation_trace.jsonl.gz"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=None, help="default: the shared trace")
    parser.add_argument("--engines", default="1,2,4,8,16,64,256")
    parser.add_argument("--routes", default="sticky,random")
    parser.add_argument("--capacity", type=int, default=1638, help="primary blocks per engine")
    parser.add_argument("--shared-blocks", type=int, default=6553)
    parser.add_argument("--block-bytes", type=int, default=256)
    parser.add_argument("--write", default="through", choices=("through", "back"))
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="replays at once (processes)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    trace = args.trace or (SHARED_TRACE if SHARED_TRACE.exists() else SHIPPED_TRACE)
    engines = [int(n) for n in args.engines.split(",")]
    routes = args.routes.split(",")
    shared_bytes = args.shared_blocks * object_bytes(args.block_bytes)
    config = {
        "primary": {"eviction": "lru"},
        "promotion": {"gate": "always", "deadline": "10s"},  # real time: room when loaded
        "faults": {"timeout": "10s"},
        "tiers": [
            {"name": "shared", "type": "memory", "capacity": shared_bytes, "write": args.write}
        ],
    }
    jobs: list[tuple[str, int, int, str]] = []  # (what, engines, capacity, route)
    for n in engines:
        jobs += [("fleet", n, args.capacity, route) for route in (routes if n > 1 else routes[:1])]
        if n > 1:
            jobs.append(("ceiling", n, n * args.capacity, routes[0]))
    common = (str(trace), config, args.requests, args.block_bytes, args.seed)
    started = time.perf_counter()
    if args.jobs > 1:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
            results = list(pool.map(_one, [(*job, *common) for job in jobs]))
    else:
        results = [_one((*job, *common)) for job in jobs]
    seconds = time.perf_counter() - started
    done = {(r["what"], r["n"], r["route"]): r for r in results}
    rows = []
    for n in engines:
        ceiling = done[("ceiling", n, routes[0])] if n > 1 else done[("fleet", 1, routes[0])]
        for route in routes if n > 1 else routes[:1]:
            fleet = done[("fleet", n, route)]
            rows.append(
                {
                    "engines": n,
                    "route": route if n > 1 else "-",
                    "hit_rate": fleet["hit_rate"],
                    "primary_hit_rate": fleet["primary_hit_rate"],
                    "shared_hit_rate": fleet["shared_hit_rate"],
                    "cross_share": fleet["cross_share"],
                    "duplicate_writes": fleet["duplicate_writes"],
                    "writes": fleet["writes"],
                    "store_peak_bytes": fleet["store_peak_bytes"],
                    "ceiling_hit_rate": ceiling["hit_rate"],
                    "ratio": fleet["hit_rate"] / ceiling["hit_rate"] if ceiling["hit_rate"] else 0,
                    "seconds": fleet["seconds"],
                    "ceiling_seconds": ceiling["seconds"] if n > 1 else 0.0,
                }
            )
    head = {
        "trace": str(trace),
        "requests": results[0]["requests"],
        "capacity_blocks": args.capacity,
        "shared_blocks": args.shared_blocks,
        "shared_bytes": shared_bytes,
        "block_bytes": args.block_bytes,
        "write": args.write,
        "seed": args.seed,
        "seconds": round(seconds, 1),
    }
    if args.json:
        print(json.dumps({**head, "rows": rows}, indent=2))
        return 0
    print(
        f"{trace} ({head['requests']:,} requests): each engine's primary {args.capacity:,} blocks "
        f"of {args.block_bytes} bytes; one shared memory tier of {args.shared_blocks:,} blocks "
        f"({shared_bytes:,} bytes), write {args.write}; hit rates over the second half; "
        f"{seconds:.0f}s in all"
    )
    print(
        f"{'engines':>7} {'route':<6} {'fleet':>7} {'primary':>7} {'shared':>7} "
        f"{'cross':>7} {'dup.':>6} {'ceiling':>7} {'ratio':>6} {'time':>6}"
    )
    for row in rows:
        print(
            f"{row['engines']:>7} {row['route']:<6} {_pct(row['hit_rate'])} "
            f"{_pct(row['primary_hit_rate'])} {_pct(row['shared_hit_rate'])} "
            f"{_pct(row['cross_share'])} {row['duplicate_writes']:>6,} "
            f"{_pct(row['ceiling_hit_rate'])} {row['ratio']:>6.3f} {row['seconds']:>5.0f}s"
        )
    print(
        "fleet: hit rate of the fleet; primary / shared: its hits from the engines' own "
        "primaries / promoted from the shared tier; cross: of the latter, the share another "
        "engine stored; dup.: blocks written while the shared tier held them from another "
        "engine; ceiling: one engine with every primary (N x capacity), same shared tier; "
        "ratio: fleet / ceiling"
    )
    return 0


def object_bytes(block_bytes: int) -> int:
    """Bytes one stored block takes in a memory tier (its header, then the block), as a tier
    writes it."""

    async def put() -> int:
        async with MemoryTier(namespace=REPLAY_NAMESPACE) as tier:
            await tier.put(make_key(hashlib.sha256(b"size").digest()), bytes(block_bytes))
            return (await tier.stat()).bytes_used

    return asyncio.run(put())


def _one(job: tuple[Any, ...]) -> dict[str, Any]:
    what, n, capacity, route, trace, config, requests, block_bytes, seed = job
    loaded = load_trace(trace).requests
    engines = n if what == "fleet" else 1
    result = replay_fleet(
        loaded[:requests] if requests else loaded,
        parse_config(config),
        engines,
        capacity,
        route,
        seed,
        block_bytes,
    )
    fleet = result.fleet.as_dict()
    return {
        "what": what,
        "n": n,
        "route": route,
        "requests": result.requests,
        "store_peak_bytes": result.store_peak_bytes,
        "seconds": round(result.seconds, 1),
        **{k: fleet[k] for k in fleet if k != "tier"},
    }


def _pct(rate: float) -> str:
    return f"{100 * rate:6.2f}%"


if __name__ == "__main__":
    sys.exit(main())
