"""The tiering manager on the shared trace: hit rates per tier and the scheduler-side cost,
against the CPU primary alone at the same capacity, in the same run.

Three replays of the trace (`kvtier replay --config` semantics: synthesized blocks really
written to and read from the tiers, checked on the way back):

- primary only;
- primary + a file tier (write-back), in a fresh directory;
- primary + a memory tier (write-through, a quarter of the primary's size) + the file tier:
  the "two tiers configured" case for the cost comparison.

With `--record` (issue 31, item 1) the set-ups are primary + the file tier without and with
`trace.record` (the recorder's `record` call is timed with the manager's), in the same rotation.

With `--manifest S` (issue 33, item 7) the set-ups are two instead: primary + the file tier
(write-back) without a manifest of use, and the same with a warm start on and its manifest
written every S seconds (`primary.warm_manifest_interval`; 60 by default), in the same
rotation; and one manifest of `--manifest-keys` keys (a 100 GiB primary of 2 MiB blocks: 51,200)
is timed apart, as the recorder makes it: the pass under the step lock (what the scheduler can
wait for), the encoding and the write to a files directory.

Each replay pauses after every step for the model's step, which streams 16 MiB through the
caches (kvtier/replay.py, `ENGINE_SWEEP_BYTES`), in every setup. With `--repeat N` the setups
run N times each in rotated order; timings are medians and the cost ratio is the median of each
round's ratio to the primary alone's run of the same round.

    python bench/tiering.py [--capacity 6553] [--requests N] [--block-bytes 4096] [--repeat N]
                            [--dir DIR] [--manifest S [--manifest-keys N]] [--record] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvtier.replay import replay_tiered  # noqa: E402
from kvtier.trace import load_trace  # noqa: E402
from tiering.config import parse_config  # noqa: E402
from tiering.keys import BlockKey  # noqa: E402
from tiering.manager.counters import BOOKKEEPING_SECONDS, MANIFESTS_WRITTEN  # noqa: E402
from tiering.manager.manifest import Manifest, encode, record_name  # noqa: E402
from tiering.primary import PrimaryPool  # noqa: E402
from tiering.testing import NAMESPACE  # noqa: E402
from tiers.file import BlockFileTier  # noqa: E402

DEFAULT_TRACE = ROOT / "bench" / "traces" / "mooncake_conversation_trace.jsonl.gz"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--capacity", type=int, default=6553)
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--block-bytes", type=int, default=4096)
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory on a real disk")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each setup (median)")
    parser.add_argument(
        "--manifest",
        type=float,
        default=None,
        metavar="S",
        help="compare the file tier without and with a manifest of use written every S seconds",
    )
    parser.add_argument("--manifest-keys", type=int, default=51_200, help="keys of the timed one")
    parser.add_argument(
        "--record",
        action="store_true",
        help="the cost of trace.record: primary + file with and without recording the trace",
    )
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
    if args.manifest is not None:
        file_only = configs["primary + file"]
        manifest = {
            **base,
            "primary": {
                "eviction": "lru",
                "warm_start": args.capacity * args.block_bytes,
                "warm_manifest_interval": args.manifest,
            },
            "tiers": [{**file_only["tiers"][0], "path": str(scratch / "m")}],
        }
        configs = {"primary + file": file_only, "primary + file + manifest": manifest}
    if args.record:
        file_only = configs["primary + file"]
        recording = {**file_only, "trace": {"record": str(scratch / "trace.jsonl")}}
        configs = {"primary + file": file_only, "primary + file, recording": recording}
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
                (scratch / "trace.jsonl").unlink(missing_ok=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = [_median_row(runs[name], runs[names[0]]) for name in names]
    one = None if args.manifest is None else manifest_write_cost(args.manifest_keys, args.dir)
    if args.json:
        print(
            json.dumps(
                {
                    "capacity": args.capacity,
                    "requests": len(requests),
                    "repeat": args.repeat,
                    "rows": rows,
                    "manifest": one,
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
        if row["manager"].get(MANIFESTS_WRITTEN):
            print(f"{'':<24} manifests written: {row['manager'][MANIFESTS_WRITTEN]:.0f}")
    if one is not None:
        print(
            f"one manifest of {one['keys']:,} keys ({one['bytes']:,} bytes), median of "
            f"{one['repeat']}: pass under the step lock {1e3 * one['pass_s']:.1f} ms, encoding "
            f"{1e3 * one['encode_s']:.1f} ms, write to a files directory "
            f"{1e3 * one['write_s']:.1f} ms; every {args.manifest:g} s: "
            f"{100 * one['total_s'] / args.manifest:.3f} % of one thread"
        )
    return 0


def manifest_write_cost(keys: int, where: Path | None, repeat: int = 5) -> dict[str, Any]:
    """One manifest of `keys` vLLM-sized keys (36 bytes), made as the recorder makes it:
    `PrimaryPool.hottest` over a full LRU pool, `encode`, `write_record` to a files
    directory (temporary file, fsync, rename); median seconds of each over `repeat`."""
    pool = PrimaryPool(keys, "lru")
    stored = [
        BlockKey(hashlib.sha256(i.to_bytes(8, "big")).digest() + b"\0" * 4) for i in range(keys)
    ]
    grant = pool.prepare_store(stored)
    assert grant is not None
    pool.complete_store(set(grant.keys))
    scratch = Path(tempfile.mkdtemp(prefix="kvtier-manifest-", dir=where))
    times: dict[str, list[float]] = {"pass_s": [], "encode_s": [], "write_s": []}
    size = 0

    async def write(data: bytes) -> None:
        async with BlockFileTier(name="nvme", path=scratch, min_free=0, namespace=NAMESPACE) as t:
            began = time.perf_counter()
            await t.write_record(record_name("bench"), data)
            times["write_s"].append(time.perf_counter() - began)

    try:
        for _ in range(repeat):
            t0 = time.perf_counter()
            order = pool.hottest(pool.num_slots)
            t1 = time.perf_counter()
            data = encode(Manifest(NAMESPACE, "bench", order))
            t2 = time.perf_counter()
            times["pass_s"].append(t1 - t0)
            times["encode_s"].append(t2 - t1)
            size = len(data)
            asyncio.run(write(data))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    figures = {what: statistics.median(values) for what, values in times.items()}
    return {
        "keys": keys,
        "bytes": size,
        "repeat": repeat,
        **figures,
        "total_s": sum(figures.values()),
    }


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
