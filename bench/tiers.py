"""Secondary tiers against raw baselines on the same disk or server, in the same run.

- file tier, both layouts (a file per block; segment files): puts and gets of 256 KiB and 2 MiB
  blocks, one at a time, `--clients` calls in flight, and batches of `--clients`
  (`put_many`/`get_many`, the manager's way), against `fio`
  (or `dd` when fio is missing) writing and reading the same number of bytes with O_DIRECT in
  the same directory, same block size, as many jobs, queue depth 1. Target: at least 0.8.
- redis tier: puts and gets with `--clients` calls in flight against `redis-benchmark -t set,get`
  with the same value size, `-c` clients and keyspace (`-r 64`: both cycle over 64 keys) on the
  same server. Target: at least 0.7.
- redis tier, one promotion-sized batch: `put_many` / `get_many` of 128 blocks of 512 KiB (64
  MiB, bench/ttft.py's prompt) with the tier's `streams` at 1, 2 (the default), 4 and 32, and at
  the default beside a thread spinning in Python (vLLM's engine loop, as the tier's thread meets
  it) with the compiled reply reader and with the Python one, against redis-benchmark GETs and
  SETs of as many values of that size from 16 clients, same server. Target for the default: at
  least 0.7.
- s3 tier: puts and gets with `--clients` calls in flight against plain boto3 put_object /
  get_object from as many threads, same client settings, same bucket. Target: at least 0.9.

Every "N calls in flight" is N clients each making its next call when its last one ends, as
redis-benchmark's clients and fio's jobs do.

Servers are started on loopback for the run (redis-server, SeaweedFS), as the tests do.

    python bench/tiers.py [--dir DIR] [--tiers file,redis,redis-batch,s3] [--aio on|off|both]
                          [--json]

`--tiers redis` includes the batch case; `redis-batch` runs it alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvtier.baselines import (  # noqa: E402
    REDIS_KEYSPACE,
    gib_s,
    plain_boto3,
    raw_disk,
    redis_benchmark,
    slot,
    tier_rates,
    timed,
)
from kvtier.servers import RedisServer, SeaweedS3  # noqa: E402
from tiering.testing import NAMESPACE, key, payload  # noqa: E402
from tiering.tier import Tier  # noqa: E402
from tiers.file import FileTier  # noqa: E402
from tiers.redis import RedisTier  # noqa: E402
from tiers.s3 import S3Tier  # noqa: E402

SIZES = (256 << 10, 2 << 20)


def summarize(runs: list[dict[str, float]]) -> dict[str, float]:
    """Median of each figure over the repetitions, and the median of the per-repetition
    ratios: each tier run is compared with the baseline run right after it (the disk and the
    two shared cores drift a lot between runs, so ratios of separate maxima would mislead)."""
    import statistics

    out = {name: statistics.median(run[name] for run in runs) for name in runs[0]}
    out["put_ratio"] = statistics.median(run["put"] / run["raw_write"] for run in runs)
    out["get_ratio"] = statistics.median(run["get"] / run["raw_read"] for run in runs)
    return out


# -- file ---------------------------------------------------------------------------------------


def bench_file(
    directory: Path,
    clients: int,
    repeat: int,
    layouts: Sequence[str] = ("files", "segments"),
    aio: Sequence[bool] = (True,),
    megabytes: int = 512,
) -> list[dict[str, Any]]:
    """`aio`: the segment layout with kernel AIO (True), through its thread pool (False), or
    both, as separate rows; both run in every repetition, in alternating order, against the
    same baseline run (the disk drifts between repetitions). `megabytes` moved per run."""
    rows = []
    for layout, size in ((layout, size) for layout in layouts for size in SIZES):
        count = max(2 * clients, (megabytes << 20) // size)
        variants = list(aio) if layout == "segments" else [True]
        for jobs, batched in ((1, False), (clients, False), (clients, True)):
            runs: dict[bool, list[dict[str, float]]] = {v: [] for v in variants}
            tool = ""
            for rep in range(repeat):
                rates = {}
                for use_aio in variants if rep % 2 == 0 else variants[::-1]:
                    root = directory / f"file-tier-{rep}"
                    tier = FileTier.variant({"layout": layout})(
                        namespace=NAMESPACE,
                        path=root,
                        min_free=0,
                        concurrency=jobs,
                        **({"aio": use_aio} if layout == "segments" else {}),
                    )
                    rates[use_aio] = asyncio.run(_run_and_close(tier, size, count, jobs, batched))
                    shutil.rmtree(root, ignore_errors=True)
                write, read, tool = raw_disk(directory, size, count, jobs)
                for use_aio, (put, get) in rates.items():
                    runs[use_aio].append(
                        {"put": put, "get": get, "raw_write": write, "raw_read": read}
                    )
            how = f"batches of {jobs}" if batched else f"{jobs} call(s) in flight"
            for use_aio in variants:
                name = "file" if layout == "files" else "file/segments"
                rows.append(
                    {
                        "tier": name if use_aio else f"{name}/threads",
                        "block_bytes": size,
                        "in_flight": jobs,
                        "baseline": f"{tool} O_DIRECT, {jobs} stream(s); tier: {how}",
                        **summarize(runs[use_aio]),
                    }
                )
    return rows


async def _run_and_close(
    tier: Tier,
    size: int,
    count: int,
    in_flight: int,
    batched: bool = False,
    keyspace: int | None = None,
) -> tuple[float, float]:
    async with tier:
        if batched:
            return await batch_rates(tier, size, count, in_flight, keyspace)
        return await tier_rates(tier, size, count, in_flight, keyspace)


async def batch_rates(
    tier: Tier, size: int, count: int, batch: int, keyspace: int | None = None
) -> tuple[float, float]:
    """put_many / get_many of `batch` blocks at a time (one pipeline each for Redis), over
    `keyspace` distinct keys (default: `count`)."""
    keyspace = keyspace or count
    blocks = [slot(size, payload(size, i)) for i in range(batch)]
    buffers = [slot(size) for _ in range(batch)]
    start = time.perf_counter()
    for at in range(0, count, batch):
        items = [(key((at + i) % keyspace), blocks[i]) for i in range(batch)]
        results = await tier.put_many(items)
        assert all(r is None for r in results), results
    put = time.perf_counter() - start
    start = time.perf_counter()
    for at in range(0, count, batch):
        found = await tier.get_many([(key((at + i) % keyspace), buffers[i]) for i in range(batch)])
        assert all(f is True for f in found), found
    get = time.perf_counter() - start
    total = size * (count // batch) * batch
    return gib_s(total, put), gib_s(total, get)


# -- redis --------------------------------------------------------------------------------------


async def plain_redis_py(url: str, size: int, count: int, clients: int) -> tuple[float, float]:
    """redis.asyncio SET/GET of the same values without kvtier: the library's own cost."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url, max_connections=2 * clients, socket_read_size=1 << 20)
    body = payload(size, 1)
    try:
        write = await timed(
            [lambda i=i: client.set(f"plain:{i % REDIS_KEYSPACE}", body) for i in range(count)],
            clients,
        )
        read = await timed(
            [lambda i=i: client.get(f"plain:{i % REDIS_KEYSPACE}") for i in range(count)], clients
        )
    finally:
        await client.aclose()
    return gib_s(size * count, write), gib_s(size * count, read)


def bench_redis(directory: Path, clients: int, repeat: int) -> list[dict[str, Any]]:
    server = RedisServer(directory / "redis")
    server.start()
    rows = []
    try:
        for size in SIZES:
            count = max(200, (1 << 30) // size)
            for batched in (False, True):
                runs = []
                for _ in range(repeat):
                    tier = RedisTier(namespace=NAMESPACE, url=server.url, concurrency=clients)
                    put, get = asyncio.run(
                        _run_and_close(tier, size, count, clients, batched, REDIS_KEYSPACE)
                    )
                    write, read = redis_benchmark("127.0.0.1", server.port, size, count, clients)
                    lib_write, lib_read = asyncio.run(
                        plain_redis_py(server.url, size, count, clients)
                    )
                    runs.append(
                        {
                            "put": put,
                            "get": get,
                            "raw_write": write,
                            "raw_read": read,
                            "lib_write": lib_write,
                            "lib_read": lib_read,
                        }
                    )
                row = summarize(runs)
                how = f"pipelines of {clients}" if batched else f"{clients} calls in flight"
                rows.append(
                    {
                        "tier": "redis",
                        "block_bytes": size,
                        "in_flight": clients,
                        "baseline": f"redis-benchmark -c {clients}; tier: {how}; plain redis-py "
                        f"put {row['lib_write']:.2f} get {row['lib_read']:.2f}",
                        **row,
                    }
                )
    finally:
        server.stop()
    return rows


BATCH_BLOCKS, BATCH_BLOCK_BYTES = 128, 512 << 10
"""The Redis batch case: one promotion of bench/ttft.py's 2,048-token prompt (64 MiB)."""


async def one_batch(tier: Tier, blocks: int, size: int, repeat: int) -> list[tuple[float, float]]:
    """put_many then get_many of one batch of `blocks` blocks, `repeat` times after one that is
    not timed (as in the engine: the connections are open, the server's memory is allocated,
    the buffers are mapped, as the primary's slots are): GiB/s each."""
    sources = [slot(size, payload(size, i)) for i in range(blocks)]
    buffers = [slot(size, bytes(size)) for _ in range(blocks)]  # touched: mapped
    rates = []
    async with tier:
        for _ in range(repeat + 1):
            start = time.perf_counter()
            results = await tier.put_many([(key(i), sources[i]) for i in range(blocks)])
            put = time.perf_counter() - start
            assert all(r is None for r in results), results
            start = time.perf_counter()
            found = await tier.get_many([(key(i), buffers[i]) for i in range(blocks)])
            get = time.perf_counter() - start
            assert all(f is True for f in found), found
            assert all(buffers[i] == sources[i] for i in range(blocks))
            rates.append((gib_s(blocks * size, put), gib_s(blocks * size, get)))
    return rates[1:]


class Busy:
    """A thread spinning in Python beside the tier, at the switch interval kvtier sets while
    the engine waits on it (0.5 ms): vLLM's engine loop, as the tier's thread meets it. Every
    time the tier's thread gives the GIL up (a syscall from Python does), taking it back can
    wait that long."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._spin, daemon=True)
        self.interval = sys.getswitchinterval()

    def _spin(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1

    def __enter__(self) -> Busy:
        sys.setswitchinterval(0.0005)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        sys.setswitchinterval(self.interval)


def bench_redis_batch(directory: Path, repeat: int, streams: Sequence[int]) -> list[dict[str, Any]]:
    """The tier's fast path on one promotion-sized batch, by `streams`, and at the default
    beside a busy engine thread (`Busy`) with the compiled reply reader and without it, against
    redis-benchmark on the same values in the same run (16 clients, as bench/ttft.py's limit)."""
    import tiers.redis.resp

    server = RedisServer(directory / "redis-batch")
    server.start()
    blocks, size = BATCH_BLOCKS, BATCH_BLOCK_BYTES
    compiled = tiers.redis.resp._read_replies
    cases = [(n, False, True) for n in streams]
    if compiled is not None:
        cases += [(2, True, True), (2, True, False)]
    runs: dict[tuple[int, bool, bool], list[dict[str, float]]] = {c: [] for c in cases}
    try:
        for rep in range(repeat):
            for case in cases if rep % 2 == 0 else list(reversed(cases)):
                n, busy, fast = case
                tiers.redis.resp._read_replies = compiled if fast else None
                tier = RedisTier(namespace=NAMESPACE, url=server.url, streams=n)
                with Busy() if busy else contextlib.nullcontext():
                    (put, get), *_ = asyncio.run(one_batch(tier, blocks, size, 1))
                write, read = redis_benchmark("127.0.0.1", server.port, size, blocks, 16)
                runs[case].append({"put": put, "get": get, "raw_write": write, "raw_read": read})
    finally:
        tiers.redis.resp._read_replies = compiled
        server.stop()
    rows = []
    for case in cases:
        n, busy, fast = case
        what = f"redis batch, streams {n}"
        if busy:
            what += ", busy engine, " + ("C reader" if fast else "Python reader")
        rows.append(
            {
                "tier": what,
                "block_bytes": size,
                "in_flight": blocks,
                "baseline": "redis-benchmark -c 16; tier: one put_many / get_many of the batch",
                **summarize(runs[case]),
            }
        )
    return rows


# -- s3 -----------------------------------------------------------------------------------------


def bench_s3(directory: Path, clients: int, repeat: int) -> list[dict[str, Any]]:
    server = SeaweedS3(directory / "seaweedfs")
    server.start()
    rows = []
    try:
        for size in SIZES:
            count = max(40, (128 << 20) // size)
            runs = []
            for rep in range(repeat):
                tier = S3Tier(
                    namespace=NAMESPACE,
                    bucket=server.bucket,
                    prefix=f"bench{rep}-{size}/",  # write_once: no size reuses another's keys
                    endpoint_url=server.endpoint,
                    access_key=server.ACCESS_KEY,
                    secret_key=server.SECRET_KEY,
                    concurrency=clients,
                    timeout=60,
                )
                put, get = asyncio.run(_run_and_close(tier, size, count, clients))
                write, read = plain_boto3(
                    server.endpoint,
                    server.bucket,
                    size,
                    count,
                    clients,
                    server.ACCESS_KEY,
                    server.SECRET_KEY,
                )
                runs.append({"put": put, "get": get, "raw_write": write, "raw_read": read})
            rows.append(
                {
                    "tier": "s3",
                    "block_bytes": size,
                    "in_flight": clients,
                    "baseline": f"boto3, {clients} threads",
                    **summarize(runs),
                }
            )
    finally:
        server.stop()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (a real disk)")
    parser.add_argument("--tiers", default="file,redis,s3")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--layouts", default="files,segments", help="file tier layouts")
    parser.add_argument(
        "--megabytes", type=int, default=512, help="file tier: MiB moved per run (default 512)"
    )
    parser.add_argument(
        "--aio",
        choices=("on", "off", "both"),
        default="on",
        help="segment layout: kernel AIO (on), the thread pool (off), or both as separate rows",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    directory = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=args.dir))
    rows: list[dict[str, Any]] = []
    try:
        for name in args.tiers.split(","):
            if name == "file":
                aio = {"on": (True,), "off": (False,), "both": (True, False)}[args.aio]
                rows += bench_file(
                    directory,
                    args.clients,
                    args.repeat,
                    args.layouts.split(","),
                    aio,
                    args.megabytes,
                )
            elif name == "redis":
                rows += bench_redis(directory, args.clients, args.repeat)
                rows += bench_redis_batch(directory, max(args.repeat, 5), (1, 2, 4, 32))
            elif name == "redis-batch":
                rows += bench_redis_batch(directory, max(args.repeat, 5), (1, 2, 4, 32))
            elif name == "s3":
                rows += bench_s3(directory, args.clients, args.repeat)
            else:
                parser.error(f"unknown tier {name!r}")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"median of {args.repeat}, GiB/s (tier / baseline; ratio: median per repetition)")
    for r in rows:
        size = f"{r['block_bytes'] >> 10:>5} KiB x{r['in_flight']:<2}"
        put = f"put {r['put']:.2f} / {r['raw_write']:.2f} = {r['put_ratio']:.2f}"
        get = f"get {r['get']:.2f} / {r['raw_read']:.2f} = {r['get_ratio']:.2f}"
        print(f"{r['tier']:<46} {size} {put}   {get}   ({r['baseline']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
