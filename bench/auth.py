"""What sealed objects cost: put and get throughput of a tier with `auth.secret` (every object
sealed with AES-256-GCM: GMAC over a plaintext payload, or the payload encrypted with
`auth.encrypt`) against the same tier without a secret, in the same run.

The three configurations alternate in every repetition (none, gmac, encrypt, none, ...) over
the same directory or server, and each ratio is that of a run with the secret to the run
without it right before it; the figure is the median ratio. The memory tier shows the
cryptography's CPU cost alone; the file tiers (both layouts, O_DIRECT where the disk allows),
Redis (a redis-server started on loopback) and S3 (a SeaweedFS started on loopback) what is left
of it beside real I/O.

    python bench/auth.py [--tiers memory,files,segments,redis,s3] [--sizes 256KiB,2MiB] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvtier.baselines import tier_rates  # noqa: E402
from kvtier.servers import RedisServer, SeaweedS3  # noqa: E402
from tiering.testing import NAMESPACE  # noqa: E402
from tiering.tier import Tier  # noqa: E402
from tiering.units import parse_size  # noqa: E402
from tiers.file import BlockFileTier, SegmentFileTier  # noqa: E402
from tiers.memory import MemoryTier  # noqa: E402
from tiers.redis import RedisTier  # noqa: E402
from tiers.s3 import S3Tier  # noqa: E402

SECRET = b"a deployment secret for the benchmark"
MODES = {"gmac": {"secret": SECRET}, "encrypt": {"secret": SECRET, "encrypt": True}}
TIERS = ("memory", "files", "segments", "redis", "s3")
Maker = Callable[..., Tier]


async def rates(make: Maker, options: dict[str, Any], size: int, count: int) -> Any:
    async with make(**options) as tier:
        return await tier_rates(tier, size, count, 8)


def measure(make: Maker, size: int, count: int, repeat: int) -> dict[str, float]:
    """Median ratios (and GiB/s) of each mode to no secret, alternating in every repetition."""
    ratios: dict[str, list[float]] = {}
    speeds: dict[str, list[float]] = {}
    for _ in range(repeat):
        put, get = asyncio.run(rates(make, {}, size, count))
        speeds.setdefault("none_put", []).append(put)
        speeds.setdefault("none_get", []).append(get)
        for mode, options in MODES.items():
            put_on, get_on = asyncio.run(rates(make, options, size, count))
            ratios.setdefault(f"{mode}_put", []).append(put_on / put)
            ratios.setdefault(f"{mode}_get", []).append(get_on / get)
            speeds.setdefault(f"{mode}_put", []).append(put_on)
            speeds.setdefault(f"{mode}_get", []).append(get_on)
    row = {f"{name}_ratio": statistics.median(v) for name, v in ratios.items()}
    return row | {f"{name}_gib_s": statistics.median(v) for name, v in speeds.items()}


def makers(chosen: Sequence[str], work: Path, stack: ExitStack) -> Iterator[tuple[str, Maker]]:
    """Each chosen tier's maker: a fresh tier on a fresh store for every run (a new directory,
    Redis database flushed, S3 prefix)."""
    runs = itertools.count()
    if "memory" in chosen:
        yield "memory", lambda **o: MemoryTier(namespace=NAMESPACE, **o)
    for layout, cls in (("files", BlockFileTier), ("segments", SegmentFileTier)):
        if layout in chosen:

            def make_file(cls: type[Tier] = cls, layout: str = layout, **o: Any) -> Tier:
                path = work / f"{layout}-{next(runs)}"
                return cls(namespace=NAMESPACE, path=path, min_free=0, **o)

            yield f"file ({layout})", make_file
    if "redis" in chosen:
        redis_server = RedisServer(work / "redis")
        redis_server.start()
        stack.callback(redis_server.stop)

        def make_redis(**o: Any) -> Tier:
            import redis

            client = redis.Redis.from_url(redis_server.url)
            client.flushall()
            client.close()
            return RedisTier(namespace=NAMESPACE, url=redis_server.url, **o)

        yield "redis", make_redis
    if "s3" in chosen:
        s3 = SeaweedS3(work / "s3")
        s3.start()
        stack.callback(s3.stop)

        def make_s3(**o: Any) -> Tier:
            return S3Tier(
                namespace=NAMESPACE,
                bucket=s3.bucket,
                prefix=f"auth{next(runs)}/",
                endpoint_url=s3.endpoint,
                access_key=s3.ACCESS_KEY,
                secret_key=s3.SECRET_KEY,
                concurrency=8,
                timeout=60,
                **o,
            )

        yield "s3", make_s3


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiers", default=",".join(TIERS))
    parser.add_argument("--sizes", default="256KiB,2MiB")
    parser.add_argument("--megabytes", type=int, default=128, help="moved per run and size")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (a real disk)")
    parser.add_argument(
        "--seal-in-threads",
        default=None,
        help="the block size from which sealing runs on the sealing threads (default: the "
        "product's, tiering.tier.envelope.SEAL_IN_THREADS; 'never' keeps it on the loop)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.seal_in_threads is not None:
        never = args.seal_in_threads == "never"
        Tier.seal_in_threads = (
            1 << 62 if never else parse_size(args.seal_in_threads, "--seal-in-threads")
        )
    sizes = [parse_size(s, "--sizes") for s in args.sizes.split(",")]
    chosen = args.tiers.split(",")
    unknown = set(chosen) - set(TIERS)
    if unknown:
        parser.error(f"--tiers: unknown {', '.join(sorted(unknown))}; known: {', '.join(TIERS)}")
    rows = []
    with (
        tempfile.TemporaryDirectory(dir=args.dir, prefix="kvtier-bench-auth-") as scratch,
        ExitStack() as stack,
    ):
        for name, make in makers(chosen, Path(scratch), stack):
            for size in sizes:
                count = max(16, (args.megabytes << 20) // size)
                row: dict[str, Any] = {"tier": name, "block_bytes": size}
                row |= measure(make, size, count, args.repeat)
                rows.append(row)
                if not args.json:
                    print(
                        f"{name:16} {size >> 10:5} KiB  gmac put {row['gmac_put_ratio']:.2f} "
                        f"get {row['gmac_get_ratio']:.2f}  encrypt put "
                        f"{row['encrypt_put_ratio']:.2f} get {row['encrypt_get_ratio']:.2f}  "
                        f"(none: put {row['none_put_gib_s']:.2f} get {row['none_get_gib_s']:.2f}"
                        " GiB/s)",
                        flush=True,
                    )
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
