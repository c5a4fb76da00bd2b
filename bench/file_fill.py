"""How much of its capacity a `files` directory shared by N writers holds in objects once warm,
for each block size (issue 44, item 3).

N `BlockFileTier`s, each its own writer as N engines' would be (one process, one thread pool
each), put fresh blocks of one size into one directory of `--objects` objects' capacity (the
capacity in bytes is that many times what one object takes on the disk, as the directory's
count charges it) until they have written three times the capacity. Once they have written it
once and a half (warm), the object files under the directory are summed every few batches:
reported are the least and the mean of those sums against the capacity, and the directory's
count (landed bytes and the room reserved by writers) at the last look.

    python bench/file_fill.py [--writers 8] [--sizes 64,4KiB,64KiB,256KiB,2MiB]
                              [--objects 512] [--dir PATH] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tiering.keys import make_key  # noqa: E402
from tiering.testing import NAMESPACE  # noqa: E402
from tiering.units import parse_size  # noqa: E402
from tiers.file import BlockFileTier  # noqa: E402

BATCH = 4
SAMPLES = 24


def held(path: Path) -> int:
    """Bytes of the object files under `path`."""
    total = 0
    for parent, _, names in os.walk(path):
        for name in names:
            if name.endswith(".kv"):
                try:
                    total += os.lstat(os.path.join(parent, name)).st_size
                except OSError:
                    pass
    return total


async def footprint(path: Path, size: int) -> int:
    """Bytes one object of a `size`-byte block takes in a directory's count."""
    async with BlockFileTier(namespace=NAMESPACE, path=path, min_free=0) as tier:
        await tier.put(make_key(hashlib.sha256(b"one").digest()), bytes(size))
    return held(path)


async def fill(path: Path, size: int, writers: int, objects: int) -> dict[str, Any]:
    one = await footprint(path / "probe", size)
    capacity = objects * one
    tiers = [
        BlockFileTier(
            namespace=NAMESPACE, path=path / "shared", min_free=0, capacity=capacity, timeout=30
        )
        for _ in range(writers)
    ]
    for tier in tiers:
        await tier.__aenter__()
    payload = bytes(size)
    rounds = 3 * objects // (writers * BATCH) + 1
    warm = rounds // 2
    every = max(1, (rounds - warm) // SAMPLES)
    shares: list[float] = []
    try:
        for r in range(rounds):

            async def put(w: int, r: int = r) -> None:
                for i in range(BATCH):
                    digest = hashlib.sha256(f"{size}/{w}/{r}/{i}".encode()).digest()
                    await tiers[w].put(make_key(digest), payload)

            await asyncio.gather(*(put(w) for w in range(writers)))
            if r >= warm and (r - warm) % every == 0:
                shares.append(held(path / "shared") / capacity)
        state = tiers[0]._shared._ledger.read()  # type: ignore[union-attr]  # (the count)
    finally:
        for tier in tiers:
            await tier.__aexit__(None, None, None)
    return {
        "block_bytes": size,
        "object_bytes": one,
        "capacity": capacity,
        "capacity_objects": objects,
        "least": min(shares),
        "mean": statistics.mean(shares),
        "count_used": None if state is None else state.used / capacity,
        "count_reserved": None if state is None else state.reserved / capacity,
        "samples": len(shares),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--sizes", default="64,4KiB,64KiB,256KiB,2MiB")
    parser.add_argument("--objects", type=int, default=512, help="capacity in objects")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sizes = [parse_size(s, "--sizes") for s in args.sizes.split(",")]
    rows = []
    for size in sizes:
        with tempfile.TemporaryDirectory(prefix="kvtier-file-fill-", dir=args.dir) as scratch:
            rows.append(asyncio.run(fill(Path(scratch), size, args.writers, args.objects)))
    if args.json:
        print(json.dumps({"writers": args.writers, "rows": rows}, indent=2))
        return 0
    print(
        f"{args.writers} writers, one directory of {args.objects} objects' capacity; objects' "
        "bytes against the capacity once warm (least, mean), the count at the end"
    )
    print(f"{'block':>9} {'object':>9} {'least':>7} {'mean':>7} {'landed':>7} {'reserved':>8}")
    for row in rows:
        print(
            f"{row['block_bytes']:>9,} {row['object_bytes']:>9,} {100 * row['least']:6.1f}% "
            f"{100 * row['mean']:6.1f}% {100 * (row['count_used'] or 0):6.1f}% "
            f"{100 * (row['count_reserved'] or 0):7.1f}%"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
