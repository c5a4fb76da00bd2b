"""The tiering manager on the shared trace: hit rates per tier and the scheduler-side cost,
against the CPU primary alone at the same capacity, in the same run.

Three replays of the trace (`kvtier replay --config` semantics: synthesized blocks really
written to and read from the tiers, checked on the way back):

- primary only;
- primary + a file tier (write-back), in a fresh directory;
- primary + a memory tier (write-through, a quarter of the primary's size) + the file tier:
  the "two tiers configured" case for the cost comparison.

    python bench/tiering.py [--capacity 6553] [--requests N] [--block-bytes 4096] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tiering.config import parse_config  # noqa: E402
from tiering.replay import load_trace, replay_tiered  # noqa: E402

DEFAULT_TRACE = ROOT / "bench" / "traces" / "mooncake_conversation_trace.jsonl.gz"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--capacity", type=int, default=6553)
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--block-bytes", type=int, default=4096)
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory on a real disk")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    trace = load_trace(args.trace)
    requests = trace.requests[: args.requests] if args.requests else trace.requests
    scratch = Path(tempfile.mkdtemp(prefix="kvtier-tiering-", dir=args.dir))
    base = {"primary": {"eviction": "lru"}, "promotion": {"gate": "always"}}
    configs = {
        "primary only": base,
        "primary + file": {
            **base,
            "tiers": [
                {
                    "name": "nvme",
                    "type": "file",
                    "path": str(scratch / "a"),
                    "min_free": 0,
                    "write": "back",
                },
            ],
        },
        "primary + memory + file": {
            **base,
            "tiers": [
                {
                    "name": "ram",
                    "type": "memory",
                    "capacity": args.capacity * args.block_bytes // 4,
                    "write": "through",
                },
                {
                    "name": "nvme",
                    "type": "file",
                    "path": str(scratch / "b"),
                    "min_free": 0,
                    "write": "back",
                },
            ],
        },
    }
    rows: list[dict[str, Any]] = []
    try:
        for name, config in configs.items():
            r = replay_tiered(requests, parse_config(config), args.capacity, args.block_bytes)
            rows.append(
                {
                    "setup": name,
                    "hit_rate": r.hit_rate,
                    "tier_hit_rates": {
                        t: n / max(r.total_tokens, 1) for t, n in r.tier_hit_tokens.items()
                    },
                    "manager_us_per_block": r.us_per_block,
                    "manager_us_per_block_by_call": {
                        call: 1e6 * seconds / max(r.block_refs, 1)
                        for call, seconds in r.seconds_by_call.items()
                    },
                    "us_per_block_handed": {
                        call: 1e6 * seconds / max(r.blocks_by_call.get(call, 1), 1)
                        for call, seconds in r.seconds_by_call.items()
                    },
                    "blocks_handed": dict(r.blocks_by_call),
                    "runtime_bookkeeping_us_per_block": 1e6
                    * r.stats["manager"].get("bookkeeping_seconds", 0.0)
                    / max(r.block_refs, 1),
                    "manager": r.stats["manager"],
                    "tiers": {
                        t: {k: v for k, v in f.items() if k != "latencies"}
                        for t, f in r.stats["tiers"].items()
                    },
                }
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    alone = rows[0]
    for row in rows:
        row["hit_rate_gain_points"] = 100 * (row["hit_rate"] - alone["hit_rate"])
        row["cost_ratio"] = row["manager_us_per_block"] / alone["manager_us_per_block"]
        # The same operation per block, with tiers vs without: what the tiers add to each call,
        # apart from the change in the mix of calls that their hits bring.
        row["per_call_ratio"] = {
            call: us / alone["us_per_block_handed"][call]
            for call, us in row["us_per_block_handed"].items()
            if alone["us_per_block_handed"].get(call)
        }
    if args.json:
        print(
            json.dumps(
                {"capacity": args.capacity, "requests": len(requests), "rows": rows},
                indent=2,
                default=str,
            )
        )
        return 0
    print(
        f"{len(requests):,} requests, primary {args.capacity:,} blocks of {args.block_bytes} bytes"
    )
    for row in rows:
        tiers = ", ".join(f"{t} {100 * v:.2f}%" for t, v in row["tier_hit_rates"].items())
        gain = f"{row['hit_rate_gain_points']:+.2f} pt"
        cost = f"{row['manager_us_per_block']:.1f} us/block (x{row['cost_ratio']:.2f})"
        print(
            f"{row['setup']:<24} hit rate {100 * row['hit_rate']:6.2f}% ({gain}; "
            f"from tiers: {tiers or '-'})  manager {cost}"
        )
        calls = ", ".join(f"{c} {us:.2f}" for c, us in row["manager_us_per_block_by_call"].items())
        print(
            f"{'':<24} us/block by call: {calls}; on the runtime's thread "
            f"{row['runtime_bookkeeping_us_per_block']:.2f}"
        )
        handed = ", ".join(
            f"{c} {us:.2f} (x{row['per_call_ratio'].get(c, 0):.2f}, {row['blocks_handed'][c]:,})"
            for c, us in row["us_per_block_handed"].items()
        )
        print(f"{'':<24} us per block handed to the call (vs primary only, blocks): {handed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
