"""What authenticated objects cost: put and get throughput of a tier with a secret (every
object carries an HMAC-SHA256 over header and payload, checked on every read) against the same
tier without one, in the same run.

The two configurations alternate in every repetition (off, on, off, on, ...) over the same
directory or server, and each ratio is that of a run with the secret to the run without it
right before it; the figure is the median ratio. The memory tier shows the MAC's CPU cost
alone; the file tier (segment layout, O_DIRECT where the disk allows) and Redis (a
redis-server started on loopback) what is left of it beside real I/O.

    python bench/auth.py [--tiers memory,file,redis] [--sizes 64KiB,256KiB,2MiB] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.servers import RedisServer  # noqa: E402
from tiering.testing import NAMESPACE  # noqa: E402
from tiering.tier import Tier  # noqa: E402
from tiering.units import parse_size  # noqa: E402
from tiers.baselines import tier_rates  # noqa: E402
from tiers.file import FileTier  # noqa: E402
from tiers.memory import MemoryTier  # noqa: E402
from tiers.redis import RedisTier  # noqa: E402

SECRET = b"a deployment secret for the benchmark"


async def rates(make: Callable[..., Tier], secret: bytes | None, size: int, count: int) -> Any:
    async with make(secret=secret) as tier:
        return await tier_rates(tier, size, count, 8)


def measure(
    make: Callable[..., Tier], size: int, count: int, repeat: int, clear: Callable[[], None]
) -> dict[str, float]:
    puts, gets, put_on, get_on = [], [], [], []
    for _ in range(repeat):
        clear()
        put, get = asyncio.run(rates(make, None, size, count))
        clear()
        put_mac, get_mac = asyncio.run(rates(make, SECRET, size, count))
        puts.append(put_mac / put)
        gets.append(get_mac / get)
        put_on.append(put_mac)
        get_on.append(get_mac)
    return {
        "put_ratio": statistics.median(puts),
        "get_ratio": statistics.median(gets),
        "put_gib_s_with_secret": statistics.median(put_on),
        "get_gib_s_with_secret": statistics.median(get_on),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiers", default="memory,file,redis")
    parser.add_argument("--sizes", default="64KiB,256KiB,2MiB")
    parser.add_argument("--megabytes", type=int, default=256, help="moved per run and size")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (a real disk)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    sizes = [parse_size(s, "--sizes") for s in args.sizes.split(",")]
    chosen = args.tiers.split(",")
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="kvtier-bench-auth-") as scratch:
        work = Path(scratch)
        makers: dict[str, tuple[Callable[..., Tier], Callable[[], None]]] = {}
        if "memory" in chosen:
            makers["memory"] = (lambda **o: MemoryTier(namespace=NAMESPACE, **o), lambda: None)
        if "file" in chosen:

            def make_file(**options: Any) -> Tier:
                return FileTier(
                    namespace=NAMESPACE,
                    path=work / "file",
                    min_free=0,
                    layout="segments",
                    **options,
                )

            makers["file (segments)"] = (make_file, lambda: _empty(work / "file"))
        server = None
        if "redis" in chosen:
            server = RedisServer(work / "redis")
            server.start()
            url = server.url
            makers["redis"] = (
                lambda **o: RedisTier(namespace=NAMESPACE, url=url, **o),
                lambda: None,
            )
        try:
            for name, (make, clear) in makers.items():
                for size in sizes:
                    count = max(16, (args.megabytes << 20) // size)
                    row = {"tier": name, "block_bytes": size}
                    row |= measure(make, size, count, args.repeat, clear)
                    rows.append(row)
                    if not args.json:
                        print(
                            f"{name:16} {size >> 10:5} KiB  put {row['put_ratio']:.2f}  "
                            f"get {row['get_ratio']:.2f}  (with the secret: put "
                            f"{row['put_gib_s_with_secret']:.2f} GiB/s, get "
                            f"{row['get_gib_s_with_secret']:.2f} GiB/s)",
                            flush=True,
                        )
        finally:
            if server is not None:
                server.stop()
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


def _empty(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
