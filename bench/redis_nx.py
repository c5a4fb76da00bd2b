"""What writing once costs the Redis tier: SET NX against a plain SET, in the same run.

The same batches as the tier's fast path sends them (`tiers.redis.resp.set_command`, pipelines
of `tiers.redis.pipelines.PIPELINE_BYTES` of values, `--streams` of them at once on as many
connections), to one redis-server on loopback started for the run, in alternating rounds:

- new keys: every key absent (the server flushed before each round, outside the timing): what
  NX adds to a write that lands;
- held keys: every key already there (a block another engine wrote first): SET rewrites each
  value, SET NX answers nil and stores nothing.

Reported: the median seconds of each, GiB/s of values sent, and the ratio NX / plain (below 1:
NX is cheaper).

    python bench/redis_nx.py [--batch 64MiB] [--sizes 16KiB,512KiB] [--repeat 9] [--json]

Each batch is `--batch` bytes of values (4096 blocks of 16 KiB, 128 of 512 KiB: a promotion of
bench/ttft.py's prompt).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvtier.servers import HOST, RedisServer  # noqa: E402
from tiering.units import parse_size  # noqa: E402
from tiers.redis.pipelines import PIPELINE_BYTES  # noqa: E402
from tiers.redis.resp import RespConnection, command, set_command  # noqa: E402
from tiers.redis.resp_pool import RespPool  # noqa: E402


async def batch(pool: RespPool, requests: list[list[Any]], streams: int) -> float:
    """Seconds to send `requests` (one list of SETs per pipeline) and read every reply."""
    gate = asyncio.Semaphore(streams)

    async def pipeline(parts: list[Any], count: int) -> None:
        async def exchange(conn: RespConnection) -> None:
            await conn.send(parts)
            for _ in range(count):
                await conn.reply()

        async with gate:
            await pool.run(exchange)

    start = time.perf_counter()
    await asyncio.gather(*(pipeline(parts, count) for parts, count in requests))
    return time.perf_counter() - start


def pipelines(names: list[bytes], value: bytes, nx: bool, per_pipeline: int) -> list[list[Any]]:
    out = []
    for at in range(0, len(names), per_pipeline):
        parts: list[Any] = []
        chunk = names[at : at + per_pipeline]
        for name in chunk:
            parts += set_command(name, [value], None, nx=nx)
        out.append([parts, len(chunk)])
    return out


async def measure(port: int, blocks: int, size: int, repeat: int, streams: int) -> dict[str, Any]:
    pool = RespPool(HOST, port, size=streams)
    flush = [command("FLUSHALL")]

    async def flushall(conn: RespConnection) -> None:
        await conn.send(flush)
        await conn.reply()

    value = bytes(range(256)) * (size // 256) + bytes(size % 256)
    names = [b"kvtier:bench:%08d" % i for i in range(blocks)]
    per = max(1, PIPELINE_BYTES // size)
    times: dict[str, list[float]] = {k: [] for k in ("new SET", "new NX", "held SET", "held NX")}
    for round in range(repeat):
        order = (False, True) if round % 2 == 0 else (True, False)  # alternate: no order bias
        for nx in order:
            await pool.run(flushall)
            times[f"new {'NX' if nx else 'SET'}"].append(
                await batch(pool, pipelines(names, value, nx, per), streams)
            )
        await batch(pool, pipelines(names, value, False, per), streams)  # every key held
        for nx in order:
            times[f"held {'NX' if nx else 'SET'}"].append(
                await batch(pool, pipelines(names, value, nx, per), streams)
            )
    pool.close()
    medians = {k: statistics.median(v) for k, v in times.items()}
    sent = blocks * size / (1 << 30)
    return {
        "size": size,
        "blocks": blocks,
        "seconds": medians,
        "gib_s": {k: sent / v for k, v in medians.items()},
        "ratio_new": medians["new NX"] / medians["new SET"],
        "ratio_held": medians["held NX"] / medians["held SET"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="64MiB", help="bytes of values per batch")
    parser.add_argument("--sizes", default="16KiB,512KiB")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    sizes = [parse_size(s, "--sizes") for s in args.sizes.split(",")]
    total = parse_size(args.batch, "--batch")
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-nx-") as scratch:
        server = RedisServer(Path(scratch) / "redis")
        server.start()
        try:
            results = [
                asyncio.run(
                    measure(server.port, max(1, total // size), size, args.repeat, args.streams)
                )
                for size in sizes
            ]
        finally:
            server.stop()
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"{'block':>8} {'case':>10} {'SET GiB/s':>10} {'NX GiB/s':>10} {'NX / SET':>9}")
    for r in results:
        for case in ("new", "held"):
            g = r["gib_s"]
            print(
                f"{r['size'] >> 10:>6}Ki {case + ' keys':>10} {g[case + ' SET']:>10.2f} "
                f"{g[case + ' NX']:>10.2f} {r['ratio_' + case]:>9.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
