"""Raw read bandwidth of the media a returning prompt's KV comes from, measured on the very bytes
a tier holds: what bench/ttft.py divides the KV bytes by for each set-up's limit.

- host memory: a numpy copy of the KV bytes (the primary's load is a copy between host buffers);
- disk: the tier's own files read with O_DIRECT (the page cache cannot serve them, as it
  cannot serve the file tier, which reads with O_DIRECT too), each in reads of up to 4 MiB,
  from a pool of threads; buffered, and said so, where the filesystem refuses O_DIRECT (tmpfs);
- Redis: one pipeline of GETs of every key the tier wrote, with redis-py (hiredis), and
  `redis-benchmark` GETs of values of the tier's block size (its C client parses replies faster
  than redis-py, and kvtier's own RESP client beats redis-py too): the faster of the two;
- S3: a GET of every object the tier wrote, from a pool of boto3 threads.

Each figure is the best of `repeat` passes (a limit is what the medium can do, not its average)
and comes with its bytes and a few words saying how it was measured.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHUNK = 4 << 20
"""Bytes per disk read at most: a whole object of the `files` layout (a block of the benchmark's
model, 1 MiB, and its header) in one read, a segment file in reads of this size."""
THREADS = 16
"""Reads in flight: the default `concurrency` of the file and S3 tiers."""
DISK_THREADS = (1, 4, THREADS)
"""Thread counts `disk_read` tries, keeping the fastest (on 2 busy cores, 16 Python threads read
slower than 4)."""


@dataclass(frozen=True, slots=True)
class Bandwidth:
    """A raw read rate: `nbytes` in `seconds` (the best pass), measured as `method` says."""

    nbytes: int
    seconds: float
    method: str

    @property
    def gib_s(self) -> float:
        return self.nbytes / self.seconds / 2**30

    def seconds_for(self, nbytes: int) -> float:
        """How long `nbytes` take at this rate."""
        return nbytes / (self.nbytes / self.seconds)

    def as_dict(self) -> dict[str, Any]:
        return {
            "bytes": self.nbytes,
            "seconds": self.seconds,
            "gib_s": self.gib_s,
            "method": self.method,
        }


def best(passes: int, run: Callable[[], int]) -> tuple[int, float]:
    """The bytes and the shortest time of `passes` calls of `run` (which returns its bytes)."""
    times, nbytes = [], 0
    for _ in range(passes):
        start = time.perf_counter()
        nbytes = run()
        times.append(time.perf_counter() - start)
    return nbytes, min(times)


def memcpy(nbytes: int, repeat: int = 5) -> Bandwidth:
    """A numpy copy of `nbytes` between two host buffers already touched (as a primary slot
    and the engine's KV cache are)."""
    import numpy as np

    source = np.ones(nbytes, dtype=np.uint8)
    target = np.zeros(nbytes, dtype=np.uint8)

    def copy() -> int:
        np.copyto(target, source)
        return nbytes

    copy()
    size, seconds = best(repeat, copy)
    return Bandwidth(size, seconds, "numpy copyto, one thread")


def disk_read(files: Iterable[Path], repeat: int = 3) -> Bandwidth:
    """Every byte of `files`, in reads of up to `CHUNK`, with O_DIRECT (or buffered where the
    filesystem refuses it, said in `method`), from each of `DISK_THREADS` thread counts: the
    fastest."""
    paths = sorted(files)
    return max((_read_files(paths, repeat, t) for t in DISK_THREADS), key=lambda b: b.gib_s)


def _read_files(paths: list[Path], repeat: int, threads: int) -> Bandwidth:
    if not paths:
        raise ValueError("no files to read")
    direct = _direct_ok(paths[0])
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    reads = [(p, at) for p in paths for at in range(0, p.stat().st_size, CHUNK)]
    local = threading.local()

    def read(fd: int, at: int) -> int:
        if not hasattr(local, "buffer"):
            local.buffer = memoryview(mmap.mmap(-1, CHUNK))  # page-aligned, as O_DIRECT needs
        return os.preadv(fd, [local.buffer], at)

    def read_all() -> int:
        fds = {p: os.open(p, flags) for p in paths}
        try:
            with ThreadPoolExecutor(threads) as pool:
                return sum(pool.map(lambda r: read(fds[r[0]], r[1]), reads))
        finally:
            for fd in fds.values():
                os.close(fd)

    size, seconds = best(repeat, read_all)
    how = "O_DIRECT" if direct else "buffered (the filesystem refuses O_DIRECT)"
    return Bandwidth(
        size,
        seconds,
        f"{how} reads of the tier's {len(paths)} files, up to {CHUNK >> 20} MiB each, "
        f"{threads} thread(s)",
    )


def _direct_ok(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    return True


def redis_get(url: str, pattern: bytes, repeat: int = 3, clients: int = THREADS) -> Bandwidth:
    """The faster of one pipeline of GETs of every key matching `pattern` (redis-py) and
    `redis-benchmark` GETs, from `clients` connections, of as many values of their mean size."""
    import redis

    from kvtier.baselines import redis_benchmark

    client = redis.Redis.from_url(url, socket_read_size=1 << 20)
    try:
        names = list(client.scan_iter(match=pattern, count=1000))
        if not names:
            raise ValueError(f"no Redis keys match {pattern!r}")

        def get_all() -> int:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.get(name)
            return sum(len(v) for v in pipe.execute())

        size, seconds = best(repeat, get_all)
        host, port = (
            client.connection_pool.connection_kwargs["host"],
            client.connection_pool.connection_kwargs["port"],
        )
    finally:
        client.close()
    pipelined = Bandwidth(size, seconds, f"redis-py pipeline of {len(names)} GETs")
    count = max(len(names), 4 * clients)
    value = size // len(names)
    rates = [redis_benchmark(host, port, value, count, clients)[1] for _ in range(repeat)]
    benchmark = Bandwidth(
        value * count,
        value * count / (max(rates) * 2**30),
        f"redis-benchmark -c {clients}, {count} GETs of {value} bytes",
    )
    faster, slower = sorted((pipelined, benchmark), key=lambda b: -b.gib_s)
    return Bandwidth(
        faster.nbytes,
        faster.seconds,
        f"{faster.method} (the faster; {slower.method}: {slower.gib_s:.3g} GiB/s)",
    )


def s3_get(
    client: Any, bucket: str, prefix: str, repeat: int = 3, threads: int = THREADS
) -> Bandwidth:
    """A GET of every object under `prefix`, from `threads` boto3 threads (`client`: a boto3
    S3 client allowing that many connections)."""
    names = [
        o["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        for o in page.get("Contents", [])
    ]
    if not names:
        raise ValueError(f"no objects under s3://{bucket}/{prefix}")

    def get_all() -> int:
        with ThreadPoolExecutor(threads) as pool:
            return sum(
                pool.map(
                    lambda n: len(client.get_object(Bucket=bucket, Key=n)["Body"].read()), names
                )
            )

    size, seconds = best(repeat, get_all)
    return Bandwidth(size, seconds, f"boto3 GETs of {len(names)} objects, {threads} threads")
