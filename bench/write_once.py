"""How many writes a fleet avoids by writing each block once: K engines' tiers, each in a process
of its own, put the same blocks into one store at the same time (engines of one namespace that
computed the same prefix at once: a shared system prompt, a conversation's turn served twice).

Per medium (a redis-server, SeaweedFS single objects and packs, a `files` directory, each
started for the run on 127.0.0.1 or in a temporary directory): the puts the fleet made, the
duplicates the tiers counted (the store held the block already: nothing written), the bytes
written against the bytes put, and the objects the store holds at the end (one per block when
every engine's copy but the first was a duplicate). The S3 tier also runs with `write_once:
false` in the same command, as the baseline: every put lands and replaces.

    python bench/write_once.py [--engines 3] [--blocks 256] [--size 256KiB] [--media ...] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvtier.servers import RedisServer, SeaweedS3  # noqa: E402
from tiering.config import parse_config, tier_from_config  # noqa: E402
from tiering.testing import NAMESPACE, key, payload  # noqa: E402
from tiering.tier import Tier  # noqa: E402
from tiering.units import parse_size  # noqa: E402

MEDIA = ("redis", "s3", "s3-packs", "files", "s3-replacing")
BATCH = 16


def open_tier(tier: dict[str, Any], **extra: Any) -> Tier:
    """The tier of the YAML entry `tier` (its `type` and options), as an engine opens it."""
    config = parse_config({"tiers": [{"name": "shared", **tier}]})
    return tier_from_config(config.tiers[0], NAMESPACE, config, **extra)


def engine(
    tier: dict[str, Any], blocks: int, size: int, start: Any, delay: float, out: Any
) -> None:
    """One engine's tier: connect, wait for every engine and `delay` seconds more, put every
    block, report."""

    async def run() -> dict[str, Any]:
        async with open_tier(tier) as t:
            await t.contains([key(0)])  # connected, as a running engine is
            await asyncio.to_thread(start.wait)
            await asyncio.sleep(delay)
            began = time.perf_counter()
            errors = 0
            for at in range(0, blocks, BATCH):
                items = [(key(i), payload(size, i)) for i in range(at, min(blocks, at + BATCH))]
                errors += sum(o is not None for o in await t.put_many(items))
            seconds = time.perf_counter() - began
        return {"counters": dict(t.counters), "errors": errors, "seconds": seconds}

    out.put(asyncio.run(run()))


async def stored_objects(tier: dict[str, Any]) -> int:
    async with open_tier(tier, read_only=True) as t:
        return sum(u.objects for u in await t.usage() if u.namespace == NAMESPACE)


def run_medium(
    tier: dict[str, Any], engines: int, blocks: int, size: int, stagger: float
) -> dict[str, Any]:
    """`engines` processes on one store; engine i starts `i * stagger` seconds after the
    first."""
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Barrier(engines), ctx.Queue()
    procs = [
        ctx.Process(target=engine, args=(tier, blocks, size, start, i * stagger, out))
        for i in range(engines)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    counters = [r["counters"] for r in results]
    puts = sum(c.get("puts", 0) for c in counters)
    duplicates = sum(c.get("duplicates", 0) for c in counters)
    written = sum(c.get("bytes_written", 0) for c in counters)
    return {
        "stagger": stagger,
        "engines": engines,
        "blocks": blocks,
        "puts": puts,
        "duplicates": duplicates,
        "bytes_put": puts * size,
        "bytes_written": written,
        "written_share": written / (puts * size) if puts else 0.0,
        "objects_stored": asyncio.run(stored_objects(tier)),
        "errors": sum(r["errors"] for r in results),
        "seconds": max(r["seconds"] for r in results),
    }


def flush_redis(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    client.flushall()
    client.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--size", default="256KiB")
    parser.add_argument("--media", default=",".join(MEDIA))
    parser.add_argument(
        "--stagger",
        default="0,3",
        help="seconds between engines' starts, one run each (0: all at once; 3: each after "
        "the one before's blocks are visible, S3 packs included)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    size = parse_size(args.size, "--size")
    media = [m for m in args.media.split(",") if m]
    unknown = sorted(set(media) - set(MEDIA))
    if unknown or args.engines < 1 or args.blocks < 1:
        parser.error(f"--media: one of {', '.join(MEDIA)}; --engines and --blocks at least 1")
    staggers = [float(x) for x in args.stagger.split(",") if x]
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-write-once-") as scratch:
        work = Path(scratch)
        redis = RedisServer(work / "redis") if "redis" in media else None
        s3 = SeaweedS3(work / "s3") if any(m.startswith("s3") for m in media) else None
        for server in (redis, s3):
            if server is not None:
                server.start()
        try:
            for medium, stagger in ((m, g) for g in staggers for m in media):
                tier: dict[str, Any]
                if medium == "redis":
                    assert redis is not None
                    tier = {"type": "redis", "url": redis.url, "timeout": 10.0}
                    flush_redis(redis.url)
                elif medium == "files":
                    path = work / f"files-{stagger:g}"
                    tier = {"type": "file", "path": str(path), "min_free": 0}
                else:
                    assert s3 is not None
                    tier = {
                        "type": "s3",
                        "bucket": s3.bucket,
                        "prefix": f"{medium}-{stagger:g}/",
                        "endpoint_url": s3.endpoint,
                        "access_key": s3.ACCESS_KEY,
                        "secret_key": s3.SECRET_KEY,
                        "timeout": 30.0,
                        "blocks_per_object": 8 if medium == "s3-packs" else 1,
                        "write_once": medium != "s3-replacing",
                    }
                report[f"{medium} @{stagger:g}s"] = run_medium(
                    tier, args.engines, args.blocks, size, stagger
                )
        finally:
            if redis is not None:
                redis.stop()
            if s3 is not None:
                s3.stop()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.engines} engines put the same {args.blocks} blocks of {size} bytes at once")
    print(f"{'medium, stagger':20} {'puts':>6} {'dupl.':>6} {'written/put':>12} {'objects':>8}")
    for medium, r in report.items():
        print(
            f"{medium:20} {r['puts']:>6} {r['duplicates']:>6} {r['written_share']:>12.2f} "
            f"{r['objects_stored']:>8}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
