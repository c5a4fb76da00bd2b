"""Raw baselines for tier benchmarks: what the disk or server does without kvtier, measured the
same way (`kvtier bench`, bench/tiers.py). External tools (fio, dd, redis-benchmark) run as
subprocesses; boto3 is called directly.

Each baseline works in scratch space of its own, uniquely named, and removes it when it ends,
failed or not: a directory it creates (never one that was there), Redis keys under a prefix of
its own (never redis-benchmark's default `key:*`, which may be a user's), S3 objects under a
prefix of its own. No secret goes on a child's command line (see `redis_benchmark`).
The three baselines share the scratch-space rules and the timing (`timed`, `gib_s`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import mmap
import re
import secrets
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from tiering.errors import StateError
from tiering.testing.data import key, payload
from tiering.tier import Tier

__all__ = [
    "NoBaseline",
    "scratch_space",
    "gib_s",
    "plain_boto3",
    "raw_disk",
    "redis_benchmark",
    "remove_s3_prefix",
    "scratch_name",
    "slot",
    "tier_rates",
    "timed",
]


log = logging.getLogger(__name__)


class NoBaseline(StateError):
    """The baseline cannot be measured here (the reason says why); the tier's figures stand."""


def scratch_name() -> str:
    """A name no user's file, key or object has: `kvtier-bench-` and 32 random hex digits."""
    return f"kvtier-bench-{uuid.uuid4().hex}"


@contextmanager
def scratch_space(kind: str, options: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Tier options (to override `options`, a tier's configured ones) that put a benchmark's
    tier in scratch space of its own, removed with all it holds when the block ends, failed or
    not: a new directory under a file tier's `path` (and the directories above it that the
    benchmark had to create), a new prefix under an S3 tier's `prefix`. Other tiers get no
    options: the caller gives them a namespace of the benchmark's own and purges it."""
    name = scratch_name()
    if kind == "file":
        base = Path(options["path"])
        made = [p for p in (base, *base.parents) if not p.exists()][::-1]  # topmost first
        root = base / name
        root.mkdir(parents=True)
        try:
            yield {"path": str(root)}
        finally:
            shutil.rmtree(root, ignore_errors=True)
            for directory in reversed(made):
                with suppress(OSError):
                    directory.rmdir()
            if root.exists():
                log.warning("kvtier bench: could not remove its scratch directory %s", root)
    elif kind == "s3":
        prefix = f"{options.get('prefix', '')}{name}/"
        try:
            yield {"prefix": prefix}
        finally:
            try:
                remove_s3_prefix(
                    options.get("endpoint_url"),
                    options["bucket"],
                    prefix,
                    options.get("access_key"),
                    options.get("secret_key"),
                    options.get("region"),
                )
            except Exception as e:  # the server is gone: say what is left, keep the real error
                log.warning(
                    "kvtier bench: could not remove its scratch objects s3://%s/%s: %s",
                    options["bucket"],
                    prefix,
                    e,
                )
    else:
        yield {}


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
    if hits != count:  # a tier smaller than the run evicts (capacity); one that loses blocks
        raise StateError(
            f"tier {tier.name!r}: {hits} of {count} gets of {size}-byte blocks hit (is its "
            f"capacity smaller than {min(count, keyspace)} blocks?)"
        )
    return gib_s(size * count, put), gib_s(size * count, got)


def raw_disk(directory: Path, size: int, count: int, jobs: int) -> tuple[float, float, str]:
    """Write then read `count` blocks of `size` with O_DIRECT, `jobs` streams at once (at most
    one per block: fio refuses a stream of less than a block), in a directory of its own made
    inside `directory` (removed afterwards)."""
    jobs = max(1, min(jobs, count))
    scratch = Path(tempfile.mkdtemp(prefix="kvtier-baseline-", dir=directory))
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
    host: str,
    port: int,
    size: int,
    count: int,
    clients: int,
    password: str | None = None,
    *,
    username: str | None = None,
    db: int = 0,
) -> tuple[float, float]:
    """SET and GET GiB/s of `redis-benchmark` with `clients` connections and values of `size`,
    over `REDIS_KEYSPACE` keys of a prefix of its own (deleted afterwards, whatever happens).

    redis-benchmark (7.0) reads no password from its environment (unlike redis-cli's
    `REDISCLI_AUTH`; its binary does not even call getenv), only from `-a`, in its argv, which
    every local user can read in /proc. So the server's password never goes there: with one,
    this makes a one-time ACL user (a random password, allowed SET, GET, SELECT and PING on the
    benchmark's keys only), hands that to redis-benchmark and deletes it afterwards. A user who
    may not create ACL users gets `NoBaseline`, not a password on a command line."""
    import redis

    admin = redis.Redis(
        host=host, port=port, db=db, username=username, password=password, socket_timeout=10
    )
    prefix = scratch_name() + ":"
    auth: list[str] = []
    user = None
    try:
        if password is not None:
            user, once = prefix[:-1], secrets.token_hex(24)
            try:
                admin.acl_setuser(
                    user,
                    enabled=True,
                    passwords=[f"+{once}"],
                    keys=[f"{prefix}*"],
                    commands=["-@all", "+set", "+get", "+select", "+ping"],
                    reset=True,
                )
            except redis.RedisError as e:
                user = None
                raise NoBaseline(
                    "redis-benchmark takes a password only on its command line (readable by "
                    "every local user), so kvtier gives it a one-time ACL user, which this "
                    f"server or user does not allow ({e})"
                ) from None
            auth = ["--user", user, "-a", once]
        common = [
            *auth,
            *("-h", host, "-p", str(port), "--dbnum", str(db)),
            *("-n", str(count), "-c", str(clients), "-r", str(REDIS_KEYSPACE), "-q"),
        ]
        name = f"{prefix}__rand_int__"  # redis-benchmark puts a 12-digit key number there
        value = b"x" * size  # what its own SET test sends (-d), given on stdin (-x)
        write = _requests_per_second("SET", [*common, "-x", "SET", name], value)
        read = _requests_per_second("GET", [*common, "GET", name], b"")
        return gib_s(int(write * size), 1.0), gib_s(int(read * size), 1.0)
    finally:
        try:
            names = list(admin.scan_iter(match=f"{prefix}*", count=1000))
            if names:
                admin.delete(*names)
            if user is not None:
                admin.acl_deluser(user)
        finally:
            admin.close()


def _requests_per_second(test: str, arguments: list[str], stdin: bytes) -> float:
    """Requests per second of one redis-benchmark run of `test` (its argv stays out of
    messages: it holds the one-time password)."""
    out = ""
    arguments = list(arguments)
    for _ in range(3):  # a summary line is now and then missing from a very short run
        done = subprocess.run(
            ["redis-benchmark", *arguments], input=stdin, capture_output=True, check=False
        )
        out = (done.stdout + done.stderr).decode(errors="replace")
        found = re.search(rf"{test} \S+: ([\d.]+|inf) requests per second", out)
        if done.returncode == 0 and found and "Error from server" not in out:
            if found.group(1) != "inf":
                return float(found.group(1))
            # done within its clock's resolution: a rate needs more requests
            at = arguments.index("-n") + 1
            arguments[at] = str(int(arguments[at]) * 16)
    summary = " | ".join(line.strip() for line in out.replace("\r", "\n").splitlines()[-4:])
    raise StateError(f"redis-benchmark printed no {test} rate: {summary!r}")


def plain_boto3(
    endpoint_url: str | None,
    bucket: str,
    size: int,
    count: int,
    clients: int,
    access_key: str | None = None,
    secret_key: str | None = None,
    region: str | None = None,
    prefix: str = "",
) -> tuple[float, float]:
    """put_object and get_object GiB/s of plain boto3 from `clients` threads, on objects under
    `<prefix>kvtier-bench-<random>/` (all deleted afterwards, whatever happens)."""
    client = _s3_client(endpoint_url, access_key, secret_key, region, clients)
    scratch = f"{prefix}{scratch_name()}/"
    body = payload(size, 1)
    try:
        with ThreadPoolExecutor(clients) as pool:
            start = time.perf_counter()
            list(
                pool.map(
                    lambda i: client.put_object(Bucket=bucket, Key=f"{scratch}{i}", Body=body),
                    range(count),
                )
            )
            write = time.perf_counter() - start
            start = time.perf_counter()
            list(
                pool.map(
                    lambda i: client.get_object(Bucket=bucket, Key=f"{scratch}{i}")["Body"].read(),
                    range(count),
                )
            )
            read = time.perf_counter() - start
    finally:
        _remove_prefix(client, bucket, scratch)
    return gib_s(size * count, write), gib_s(size * count, read)


def remove_s3_prefix(
    endpoint_url: str | None,
    bucket: str,
    prefix: str,
    access_key: str | None = None,
    secret_key: str | None = None,
    region: str | None = None,
) -> int:
    """Delete every object under `prefix` (a benchmark's own scratch prefix: never a user's);
    how many there were."""
    if not prefix.rstrip("/"):
        raise ValueError("refusing to delete a whole bucket")
    return _remove_prefix(
        _s3_client(endpoint_url, access_key, secret_key, region, 1), bucket, prefix
    )


def _s3_client(
    endpoint_url: str | None,
    access_key: str | None,
    secret_key: str | None,
    region: str | None,
    clients: int,
) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=region or "us-east-1",
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        config=Config(
            retries={"mode": "standard", "max_attempts": 3}, max_pool_connections=clients
        ),
    )


def _remove_prefix(client: Any, bucket: str, prefix: str) -> int:
    removed = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        names = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if names:
            client.delete_objects(Bucket=bucket, Delete={"Objects": names, "Quiet": True})
            removed += len(names)
    return removed
