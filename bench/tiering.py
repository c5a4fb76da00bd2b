"""The tiering manager on the shared trace: hit rates per tier and the scheduler-side cost,
against the CPU primary alone at the same capacity, in the same run.

Three replays of the trace (`kvtier replay --config` semantics: synthesized blocks really
written to and read from the tiers, checked on the way back):

- primary only;
- primary + a file tier (write-back), in a fresh directory;
- primary + a memory tier (write-through, a quarter of the primary's size) + the file tier:
  the "two tiers configured" case for the cost comparison.

Each replay pauses after every step for the model's step, which streams 16 MiB through the
caches (kvtier/replay.py, `ENGINE_SWEEP_BYTES`), in every setup. With `--repeat N` the setups
run N times each in rotated order; timings are medians and the cost ratio is the median of each
round's ratio to the primary alone's run of the same round.

    python bench/tiering.py [--capacity 6553] [--requests N] [--block-bytes 4096] [--repeat N]
                            [--dir DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvtier.replay import replay_tiered  # noqa: E402
from kvtier.trace import load_trace  # noqa: E402
from tiering.config import parse_config  # noqa: E402
from tiering.manager.counters import BOOKKEEPING_SECONDS  # noqa: E402

DEFAULT_TRACE = ROOT / "bench" / "traces" / "mooncake_conversation_trace.jsonl.gz"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--capacity", type=int, default=6553)
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--block-bytes", type=int, default=4096)
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory on a real disk")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each setup (median)")
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
    names = list(configs)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    try:
        for rep in range(args.repeat):
            # Rotated order: this machine drifts by 2-3x within minutes; no setup goes first always.
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                config = configs[name]
                r = replay_tiered(requests, parse_config(config), args.capacity, args.block_bytes)
                runs[name].append(_row(name, r))
                for tier in config.get("tiers", []):  # a fresh directory for the next run
                    if "path" in tier:
                        shutil.rmtree(tier["path"], ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = [_median_row(runs[name], runs[names[0]]) for name in names]
    if args.json:
        print(
            json.dumps(
                {
                    "capacity": args.capacity,
                    "requests": len(requests),
                    "repeat": args.repeat,
                    "rows": rows,
                },
                indent=2,
                default=str,
            )
        )
        return 0
    print(
        f"{len(requests):,} requests, primary {args.capacity:,} blocks of {args.block_bytes} bytes;"
        f" median of {args.repeat} (ratio: median of the rounds' ratios to the primary alone)"
    )
    for row in rows:
        tiers = ", ".join(f"{t} {100 * v:.2f}%" for t, v in row["tier_hit_rates"].items())
        gain = f"{row['hit_rate_gain_points']:+.2f} pt"
        ratios = "/".join(f"{x:.2f}" for x in row["cost_ratios"])
        cost = f"{row['manager_us_per_block']:.1f} us/block (x{row['cost_ratio']:.2f}: {ratios})"
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
        print(
            f"{'':<24} us per block handed to any call: {row['us_per_block_handed_all']:.2f} "
            f"(x{row['handed_ratio']:.2f})"
        )
    return 0


def _row(name: str, r: Any) -> dict[str, Any]:
    return {
        "setup": name,
        "hit_rate": r.hit_rate,
        "tier_hit_rates": {t: n / max(r.total_tokens, 1) for t, n in r.tier_hit_tokens.items()},
        "manager_us_per_block": r.us_per_block,
        "manager_us_per_block_by_call": {
            call: 1e6 * seconds / max(r.block_refs, 1)
            for call, seconds in r.seconds_by_call.items()
        },
        "us_per_block_handed": {
            call: 1e6 * seconds / max(r.blocks_by_call.get(call, 1), 1)
            for call, seconds in r.seconds_by_call.items()
        },
        "us_per_block_handed_all": 1e6
        * sum(r.seconds_by_call.values())
        / max(sum(r.blocks_by_call.values()), 1),
        "blocks_handed": dict(r.blocks_by_call),
        "runtime_bookkeeping_us_per_block": 1e6
        * r.stats["manager"].get(BOOKKEEPING_SECONDS, 0.0)
        / max(r.block_refs, 1),
        "manager": r.stats["manager"],
        "tiers": {
            t: {k: v for k, v in f.items() if k != "latencies"} for t, f in r.stats["tiers"].items()
        },
    }


def _median_row(runs: list[dict[str, Any]], alone: list[dict[str, Any]]) -> dict[str, Any]:
    """The last run's counters, the median of each timing, and the median of the rounds'
    ratios (each run against the primary alone's run of the same round)."""
    median = statistics.median
    pairs = list(zip(runs, alone, strict=True))
    row = dict(runs[-1])
    for field in ("manager_us_per_block", "runtime_bookkeeping_us_per_block"):
        row[field] = median(r[field] for r in runs)
    row["us_per_block_handed_all"] = median(r["us_per_block_handed_all"] for r in runs)
    for field in ("manager_us_per_block_by_call", "us_per_block_handed"):
        row[field] = {call: median(r[field][call] for r in runs) for call in runs[-1][field]}
    row["cost_ratios"] = [r["manager_us_per_block"] / a["manager_us_per_block"] for r, a in pairs]
    row["cost_ratio"] = median(row["cost_ratios"])
    row["handed_ratio"] = median(
        r["us_per_block_handed_all"] / a["us_per_block_handed_all"] for r, a in pairs
    )
    row["hit_rate_gain_points"] = 100 * (row["hit_rate"] - alone[-1]["hit_rate"])
    # The same operation per block, with tiers vs without: what the tiers add to each call,
    # apart from the change in the mix of calls that their hits bring.
    row["per_call_ratio"] = {
        call: median(
            r["us_per_block_handed"][call] / a["us_per_block_handed"][call] for r, a in pairs
        )
        for call in runs[-1]["us_per_block_handed"]
        if all(a["us_per_block_handed"].get(call) for a in alone)
    }
    return row


if __name__ == "__main__":
    sys.exit(main())
