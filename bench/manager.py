"""Scheduler-side cost of kvtier's primary pool against vLLM 0.32's own CPUOffloadingManager.

Both managers are fed the same key stream, replayed from a request trace at the same capacity,
in the same process, alternating run by run (these machines are noisy: compare the ratio, not
the absolute figures across runs). Per request, as vLLM's connector drives a manager:

    lookup each key until the first non-HIT      -> "lookup"  (per lookup call)
    prepare_load(hit keys) ... complete_load     -> "load"    (per loaded block)
    prepare_store(the other keys), complete_store -> "store"   (per offered block)
    on_new_request / on_request_finished (vLLM)  -> "hooks"   (vLLM applies recency here)

"whole" is the sum of all four over every block reference of the trace. kvtier's figures
include turning slots into the int32 array a vLLM LoadStoreSpec carries, which vLLM's manager
does inside prepare_load / prepare_store.

    python bench/manager.py [--capacity 6553] [--repeat 5] [--python-store] [--json]

`--python-store` adds kvtier with the pool's Python store path (`pool._core = None`), the
fallback of the compiled one (tiering/_pool.c), to the same alternating runs.

vLLM comes from its own virtual environment (kvtier/venv.py, created on first use); the
script re-executes itself with that environment's python when vLLM is not importable here.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from kvtier.trace import load_trace, trace_keys  # noqa: E402
from tiering.keys import BlockKey  # noqa: E402
from tiering.primary import LookupResult, PrimaryPool  # noqa: E402

DEFAULT_TRACE = ROOT / "bench" / "traces" / "mooncake_conversation_trace.jsonl.gz"


@dataclass
class Cost:
    """Nanoseconds spent per phase and the counts they are divided by."""

    lookup_ns: int = 0
    load_ns: int = 0
    store_ns: int = 0
    hooks_ns: int = 0
    lookups: int = 0
    loaded: int = 0
    offered: int = 0
    block_refs: int = 0
    hit_blocks: int = 0
    pure_lookup_ns: int = 0

    def per_block(self) -> dict[str, float]:
        whole = self.lookup_ns + self.load_ns + self.store_ns + self.hooks_ns
        return {
            "lookup_us": self.pure_lookup_ns / max(self.block_refs, 1) / 1e3,
            "lookup_in_replay_us": self.lookup_ns / max(self.lookups, 1) / 1e3,
            "load_us": self.load_ns / max(self.loaded, 1) / 1e3,
            "store_us": self.store_ns / max(self.offered, 1) / 1e3,
            "hooks_us": self.hooks_ns / max(self.block_refs, 1) / 1e3,
            "whole_us": whole / max(self.block_refs, 1) / 1e3,
        }


def drive_kvtier(requests: Sequence[list[BlockKey]], capacity: int, policy: str) -> Cost:
    return _drive_pool(PrimaryPool(capacity, policy), requests)


def drive_kvtier_python(requests: Sequence[list[BlockKey]], capacity: int, policy: str) -> Cost:
    """kvtier with the Python store path (the fallback of tiering/_pool.c)."""
    pool = PrimaryPool(capacity, policy)
    pool._core = None
    return _drive_pool(pool, requests)


def _drive_pool(pool: PrimaryPool, requests: Sequence[list[BlockKey]]) -> Cost:
    lookup, HIT = pool.lookup, LookupResult.HIT
    clock = time.perf_counter_ns
    cost = Cost()
    for keys in requests:
        t0 = clock()
        n = 0
        for key in keys:
            if lookup(key) is not HIT:
                break
            n += 1
        t1 = clock()
        hits = keys[:n]
        np.array(pool.prepare_load(hits), dtype=np.int32)
        t2 = clock()
        grant = pool.prepare_store(keys[n:])
        if grant is not None:
            np.array(grant.slots, dtype=np.int32)
            pool.complete_store(set(grant.keys))
        t3 = clock()
        pool.complete_load(set(hits))
        t4 = clock()
        _account(cost, keys, n, t0, t1, t2, t3, t4, 0)
    t0 = clock()
    for keys in requests:
        for key in keys:
            lookup(key)
    cost.pure_lookup_ns = clock() - t0
    return cost


def drive_vllm(requests: Sequence[list[BlockKey]], capacity: int, policy: str) -> Cost:
    from vllm.v1.kv_offload.base import LookupResult as VllmLookup
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    manager = CPUOffloadingManager(capacity, cache_policy=policy)
    lookup, HIT = manager.lookup, VllmLookup.HIT
    clock = time.perf_counter_ns
    cost = Cost()
    for index, keys in enumerate(requests):
        ctx = ReqContext(req_id=str(index))
        h0 = clock()
        manager.on_new_request(ctx)
        t0 = clock()
        n = 0
        for key in keys:
            if lookup(key, ctx) is not HIT:
                break
            n += 1
        t1 = clock()
        hits = keys[:n]
        manager.prepare_load(hits, ctx)
        t2 = clock()
        out = manager.prepare_store(keys[n:], ctx)
        if out is not None:
            manager.complete_store(set(out.keys_to_store), ctx)
        t3 = clock()
        manager.complete_load(set(hits), ctx)
        t4 = clock()
        manager.on_request_finished(ctx)
        h1 = clock()
        _account(cost, keys, n, t0, t1, t2, t3, t4, (t0 - h0) + (h1 - t4))
    ctx = ReqContext(req_id="lookup")
    t0 = clock()
    for keys in requests:
        for key in keys:
            lookup(key, ctx)
    cost.pure_lookup_ns = clock() - t0
    return cost


def _account(
    cost: Cost,
    keys: list[BlockKey],
    n: int,
    t0: int,
    t1: int,
    t2: int,
    t3: int,
    t4: int,
    hooks: int,
) -> None:
    cost.lookup_ns += t1 - t0
    cost.load_ns += (t2 - t1) + (t4 - t3)
    cost.store_ns += t3 - t2
    cost.hooks_ns += hooks
    cost.lookups += min(n + 1, len(keys))
    cost.loaded += n
    cost.offered += len(keys) - n
    cost.block_refs += len(keys)
    cost.hit_blocks += n


def measure(
    driver: Callable[[Sequence[list[BlockKey]], int, str], Cost],
    requests: Sequence[list[BlockKey]],
    capacity: int,
    policy: str,
) -> Cost:
    gc.collect()
    gc.disable()  # the same for both managers; keeps collector pauses out of the comparison
    try:
        return driver(requests, capacity, policy)
    finally:
        gc.enable()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--capacity", type=int, default=6553, help="blocks (default 6553)")
    parser.add_argument("--policy", default="lru,arc", help="comma-separated (default lru,arc)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per manager (median kept)")
    parser.add_argument("--no-vllm", action="store_true", help="measure kvtier only")
    parser.add_argument(
        "--python-store",
        action="store_true",
        help="also kvtier with the Python store path (against the compiled one, same runs)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    if not args.no_vllm and not _vllm_importable():
        from kvtier.venv import ensure_vllm_venv

        python = ensure_vllm_venv()
        os.execv(str(python), [str(python), __file__, *sys.argv[1:]])

    trace = load_trace(args.trace)
    requests = trace_keys(trace.requests)
    managers: dict[str, Callable[[Sequence[list[BlockKey]], int, str], Cost]] = {
        "kvtier": drive_kvtier
    }
    if args.python_store:
        managers["kvtier-python"] = drive_kvtier_python
    if not args.no_vllm:
        managers["vllm"] = drive_vllm
    results: dict[str, dict[str, Any]] = {}
    for policy in args.policy.split(","):
        runs: dict[str, list[Cost]] = {name: [] for name in managers}
        for rep in range(args.repeat):
            order = list(managers) if rep % 2 == 0 else list(reversed(managers))
            for name in order:
                runs[name].append(measure(managers[name], requests, args.capacity, policy))
        for name, costs in runs.items():
            figures = {
                metric: statistics.median(c.per_block()[metric] for c in costs)
                for metric in costs[0].per_block()
            }
            counts = asdict(costs[0])
            results[f"{policy}/{name}"] = {
                "policy": policy,
                "manager": name,
                **figures,
                "hit_rate_blocks": counts["hit_blocks"] / counts["block_refs"],
                "lookups": counts["lookups"],
                "block_refs": counts["block_refs"],
            }
        if "vllm" in managers:
            ours, theirs = results[f"{policy}/kvtier"], results[f"{policy}/vllm"]
            ours["ratio_whole"] = ours["whole_us"] / theirs["whole_us"]
            if "kvtier-python" in managers:
                slow = results[f"{policy}/kvtier-python"]
                slow["ratio_whole"] = slow["whole_us"] / theirs["whole_us"]

    meta = {
        "trace": str(args.trace),
        "capacity_blocks": args.capacity,
        "repeat": args.repeat,
        "python": sys.version.split()[0],
    }
    if args.json:
        print(json.dumps({**meta, "results": list(results.values())}, indent=2))
    else:
        _print(meta, list(results.values()))
    return 0


def _print(meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    print(
        f"trace {meta['trace']}, capacity {meta['capacity_blocks']:,} blocks, "
        f"median of {meta['repeat']} runs each (microseconds)"
    )
    header = (
        "policy",
        "manager",
        "lookup",
        "in replay",
        "load/blk",
        "store/blk",
        "hooks/ref",
        "whole/ref",
        "ratio",
        "block hits",
    )
    table = [header]
    for r in rows:
        table.append(
            (
                r["policy"],
                r["manager"],
                f"{r['lookup_us']:.3f}",
                f"{r['lookup_in_replay_us']:.3f}",
                f"{r['load_us']:.3f}",
                f"{r['store_us']:.3f}",
                f"{r['hooks_us']:.3f}",
                f"{r['whole_us']:.3f}",
                f"{r['ratio_whole']:.2f}" if "ratio_whole" in r else "",
                f"{100 * r['hit_rate_blocks']:.1f}%",
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print(
            "  ".join(
                c.rjust(w) if i > 1 else c.ljust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )


def _vllm_importable() -> bool:
    try:
        import vllm.v1.kv_offload.cpu.manager  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
