"""What TLS costs the Redis and S3 tiers: the same batches over TLS and over plaintext, in the
same run.

Servers started for the run on loopback with a CA the run makes (`kvtier.certs`): one
redis-server listening in plaintext and one listening in TLS only; one SeaweedFS serving its S3
gateway in both (`-s3.port.https`). Each round writes a batch of new blocks with `put_many` and
reads it back with `get_many`, through the tier as vLLM's manager calls it, on each path in
turn (alternating, so drift on this machine hits all alike):

- redis plain: the fast path (`tiers.redis.resp`, the default on plaintext);
- redis plain, redis-py: `fast_path: false`, the transport TLS takes;
- redis TLS: `tls_ca_file` (redis-py over TLS; the fast path steps aside);
- s3 http and s3 https (`ca_bundle`).

Reported: the median seconds of each path's writes and reads, GiB/s of block bytes, and the
ratio TLS / plaintext of each (above 1: TLS is slower).

    python bench/tls.py [--redis-batch 64MiB] [--s3-batch 16MiB] [--size 512KiB] [--repeat 5]
                        [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvtier.certs import LocalCA  # noqa: E402
from kvtier.servers import RedisServer, SeaweedS3  # noqa: E402
from tiering.testing.data import key, payload  # noqa: E402
from tiering.tier import Tier  # noqa: E402
from tiering.units import parse_size  # noqa: E402
from tiers.redis import RedisTier  # noqa: E402
from tiers.s3 import S3Tier  # noqa: E402


async def round_trip(tier: Tier, blocks: list[tuple[bytes, bytes]]) -> tuple[float, float]:
    """Seconds to `put_many` the blocks, then to `get_many` them (every one written and read)."""
    start = time.perf_counter()
    stored = await tier.put_many(blocks)
    wrote = time.perf_counter() - start
    assert stored == [None] * len(blocks), stored[:3]
    into = [bytearray(len(data)) for _, data in blocks]
    start = time.perf_counter()
    found = await tier.get_many([(k, b) for (k, _), b in zip(blocks, into, strict=True)])
    read = time.perf_counter() - start
    assert found == [True] * len(blocks), found[:3]
    return wrote, read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis-batch", default="64MiB")
    parser.add_argument("--s3-batch", default="16MiB")
    parser.add_argument("--size", default="512KiB")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    size = parse_size(args.size, "--size")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ca = LocalCA(work / "ca")
        plain, tls = RedisServer(work / "redis"), RedisServer(work / "redis-tls", tls=ca)
        s3 = SeaweedS3(work / "s3", tls=ca)
        servers: list[Any] = [plain, tls, s3]
        try:
            for server in servers:
                server.start()
            results = asyncio.run(measure(args, size, ca, plain, tls, s3))
        finally:
            for server in servers:
                server.stop()
    report(results, args.json)


async def measure(
    args: argparse.Namespace,
    size: int,
    ca: LocalCA,
    plain: RedisServer,
    tls: RedisServer,
    s3: SeaweedS3,
) -> dict[str, Any]:
    s3_options = {
        "bucket": s3.bucket,
        "access_key": s3.ACCESS_KEY,
        "secret_key": s3.SECRET_KEY,
    }
    paths = {
        "redis plain": (lambda: {"type": RedisTier, "url": plain.url}, args.redis_batch),
        "redis plain, redis-py": (
            lambda: {"type": RedisTier, "url": plain.url, "fast_path": False},
            args.redis_batch,
        ),
        "redis TLS": (
            lambda: {"type": RedisTier, "url": tls.url, "tls_ca_file": str(ca.ca_file)},
            args.redis_batch,
        ),
        "s3 http": (
            lambda: {"type": S3Tier, "endpoint_url": s3.endpoint, **s3_options},
            args.s3_batch,
        ),
        "s3 https": (
            lambda: {
                "type": S3Tier,
                "endpoint_url": s3.https_endpoint,
                "ca_bundle": str(ca.ca_file),
                **s3_options,
            },
            args.s3_batch,
        ),
    }
    data = {name: payload(parse_size(batch, "--batch"), 7) for name, (_, batch) in paths.items()}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
    for r in range(args.repeat + 1):  # round 0 warms connections and servers, not counted
        for name, (options, _) in paths.items():
            made = options()
            kind = made.pop("type")
            if kind is S3Tier:
                made["prefix"] = f"bench-{uuid.uuid4().hex[:8]}/"
            namespace = uuid.uuid4().bytes  # new keys: every put lands
            blob = data[name]
            blocks = [
                (key(i), blob[at : at + size]) for i, at in enumerate(range(0, len(blob), size))
            ]
            async with kind(namespace=namespace, timeout=120.0, **made) as tier:
                got = await round_trip(tier, blocks)
            if r:
                times[name].append(got)
    out: dict[str, Any] = {"size": size, "repeat": args.repeat, "paths": {}}
    for name, (_, batch) in paths.items():
        nbytes = parse_size(batch, "--batch")
        write = statistics.median(t[0] for t in times[name])
        read = statistics.median(t[1] for t in times[name])
        out["paths"][name] = {
            "bytes": nbytes,
            "write_s": write,
            "read_s": read,
            "write_gib_s": nbytes / write / 2**30,
            "read_gib_s": nbytes / read / 2**30,
        }
    p = out["paths"]
    out["ratios"] = {
        f"{tls_path} / {base}": {
            "write": p[tls_path]["write_s"] / p[base]["write_s"],
            "read": p[tls_path]["read_s"] / p[base]["read_s"],
        }
        for tls_path, base in (
            ("redis TLS", "redis plain"),
            ("redis TLS", "redis plain, redis-py"),
            ("s3 https", "s3 http"),
        )
    }
    return out


def report(results: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(results, indent=2))
        return
    print(f"blocks of {results['size'] >> 10} KiB, median of {results['repeat']} rounds")
    print(f"{'path':24} {'batch':>8} {'write GiB/s':>12} {'read GiB/s':>11}")
    for name, p in results["paths"].items():
        print(
            f"{name:24} {p['bytes'] >> 20:>6}Mi {p['write_gib_s']:>12.2f} {p['read_gib_s']:>11.2f}"
        )
    print("seconds, TLS / plaintext (above 1: TLS slower)")
    for name, r in results["ratios"].items():
        print(f"  {name:40} write {r['write']:.2f}  read {r['read']:.2f}")


if __name__ == "__main__":
    main()
