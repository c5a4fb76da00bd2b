"""Raw baselines for tier benchmarks: what the disk or server does without kvtier, measured the
same way (`kvtier bench`, bench/tiers.py). External tools (fio, dd, redis-benchmark) run as
subprocesses; boto3 is called directly."""

from __future__ import annotations

import asyncio
import functools
import json
import mmap
import re
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tiering.testing import key, payload
from tiering.tier import Tier

__all__ = ["gib_s", "plain_boto3", "raw_disk", "redis_benchmark", "slot", "tier_rates", "timed"]


def gib_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 2**30


async def timed(calls: Sequence[Callable[[], Awaitable[Any]]], in_flight: int) -> float:
    """Seconds to make `calls` from `in_flight` clients, each making its next call when its last
    one ends (as redis-benchmark's clients and fio's jobs do): no task or semaphore per call, so
    the harness costs the loop next to nothing."""
    pending = iter(calls)

    async def client() -> None:
        for call in pending:
            await call()

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(in_flight)))
    return time.perf_counter() - start


def slot(size: int, fill: bytes | None = None) -> memoryview:
    """A page-aligned buffer, as a primary-region slot is."""
    mapping = mmap.mmap(-1, max(size, 1))
    if fill is not None:
        mapping[:size] = fill
    return memoryview(mapping)[:size]


async def tier_rates(
    tier: Tier, size: int, count: int, in_flight: int, keyspace: int | None = None
) -> tuple[float, float]:
    """Put then get GiB/s of `count` blocks of `size`, `in_flight` calls at a time, over
    `keyspace` distinct keys (default: `count`; redis-benchmark's `-r` cycles over a few)."""
    keyspace = keyspace or count
    blocks = [slot(size, payload(size, i)) for i in range(min(keyspace, 8))]
    put = await timed(
        [
            functools.partial(tier.put, key(i % keyspace), blocks[i % keyspace % len(blocks)])
            for i in range(count)
        ],
        in_flight,
    )
    free = [slot(size) for _ in range(in_flight)]  # one buffer per call in flight
    hits = 0

    async def get(i: int) -> None:
        nonlocal hits
        buffer = free.pop()
        try:
            # not `hits += await ...`: that would read `hits` before the call
            found = await tier.get(key(i % keyspace), buffer)
            hits += found
        finally:
            free.append(buffer)

    got = await timed([functools.partial(get, i) for i in range(count)], in_flight)
    assert hits == count, f"{hits} of {count} gets hit"
    return gib_s(size * count, put), gib_s(size * count, got)


def raw_disk(directory: Path, size: int, count: int, jobs: int) -> tuple[float, float, str]:
    """Write then read `count` blocks of `size` with O_DIRECT, `jobs` streams at once."""
    scratch = directory / "baseline"
    scratch.mkdir(exist_ok=True)
    fio = shutil.which("fio")
    try:
        if fio:
            rates = []
            for mode in ("write", "read"):
                out = subprocess.run(
                    [
                        fio,
                        "--name=kvtier",
                        f"--directory={scratch}",
                        f"--rw={mode}",
                        f"--bs={size}",
                        f"--size={size * count // jobs}",
                        "--direct=1",
                        "--ioengine=psync",
                        f"--numjobs={jobs}",
                        "--group_reporting",
                        "--output-format=json",
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
                rates.append(json.loads(out)["jobs"][0][mode]["bw_bytes"] / 2**30)
            return rates[0], rates[1], "fio"
        target = scratch / "dd.bin"  # dd has one stream: jobs is ignored
        start = time.perf_counter()
        subprocess.run(
            [
                "dd",
                "if=/dev/zero",
                f"of={target}",
                f"bs={size}",
                f"count={count}",
                "oflag=direct",
                "status=none",
            ],
            check=True,
        )
        write = time.perf_counter() - start
        start = time.perf_counter()
        subprocess.run(
            ["dd", f"if={target}", "of=/dev/null", f"bs={size}", "iflag=direct", "status=none"],
            check=True,
        )
        read = time.perf_counter() - start
        return gib_s(size * count, write), gib_s(size * count, read), "dd"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


REDIS_KEYSPACE = 64
"""Distinct keys redis-benchmark's `-r` draws from (a GET of a key its SETs missed would be a
cheap miss), and so the number the Redis tier's benchmark cycles over too: the same workload."""


def redis_benchmark(
    host: str, port: int, size: int, count: int, clients: int, password: str | None = None
) -> tuple[float, float]:
    """SET and GET GiB/s of `redis-benchmark` with `clients` connections and values of `size`."""
    auth = ["-a", password] if password else []
    command = [
        "redis-benchmark",
        *auth,
        *("-h", host, "-p", str(port), "-t", "set,get", "-d", str(size)),
        *("-n", str(count), "-c", str(clients), "-r", str(REDIS_KEYSPACE), "-q"),
    ]
    out = ""
    for _ in range(3):  # a summary line is now and then missing from a very short run
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        rates = {
            m.group(1): float(m.group(2))
            for m in re.finditer(r"(SET|GET): ([\d.]+) requests per second", out)
        }
        if rates.keys() == {"SET", "GET"}:
            return gib_s(int(rates["SET"] * size), 1.0), gib_s(int(rates["GET"] * size), 1.0)
    summary = " | ".join(line.strip() for line in out.replace("\r", "\n").splitlines()[-4:])
    raise RuntimeError(f"redis-benchmark printed no SET and GET rates: {summary!r}")


def plain_boto3(
    endpoint_url: str | None,
    bucket: str,
    size: int,
    count: int,
    clients: int,
    access_key: str | None = None,
    secret_key: str | None = None,
    region: str | None = None,
    prefix: str = "kvtier-baseline/",
) -> tuple[float, float]:
    """put_object and get_object GiB/s of plain boto3 from `clients` threads."""
    import boto3
    from botocore.config import Config

    client = boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=region or "us-east-1",
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        config=Config(
            retries={"mode": "standard", "max_attempts": 3}, max_pool_connections=clients
        ),
    )
    body = payload(size, 1)
    with ThreadPoolExecutor(clients) as pool:
        start = time.perf_counter()
        list(
            pool.map(
                lambda i: client.put_object(Bucket=bucket, Key=f"{prefix}{i}", Body=body),
                range(count),
            )
        )
        write = time.perf_counter() - start
        start = time.perf_counter()
        list(
            pool.map(
                lambda i: client.get_object(Bucket=bucket, Key=f"{prefix}{i}")["Body"].read(),
                range(count),
            )
        )
        read = time.perf_counter() - start
    return gib_s(size * count, write), gib_s(size * count, read)
