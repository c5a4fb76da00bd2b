"""What a bounded, shareable `files` directory costs one engine: the file tier's batch puts and
gets with a `capacity` (the shared byte count every put reserves room in, a hit's recency
stamp, the sweeper's thread) against the same tier without one, in the same process,
alternating, on the same disk.

Cases, each a fresh directory per repetition (fresh files: every put writes):
- `unbounded`: no capacity (no count, no stamp, no sweeper): the baseline;
- `bounded`: a capacity twice the bytes written (room is reserved, nothing is evicted).

Reported: the median GiB/s of puts and gets per case, and each as a ratio to `unbounded` in the
same repetition (then the median of the ratios).

    python bench/file_shared.py [--dir PATH] [--size 256KiB] [--mib 128] [--repeat 5] [--json]

`--dir` should be the disk the tier would live on (default: a temporary directory).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.tiers import batch_rates  # noqa: E402
from tiering.testing import NAMESPACE  # noqa: E402
from tiering.units import parse_size  # noqa: E402
from tiers.file import BlockFileTier  # noqa: E402

CASES = ("unbounded", "bounded")
BATCH = 16


async def one(case: str, path: Path, size: int, count: int) -> tuple[float, float]:
    total = size * count
    capacity = None if case == "unbounded" else 2 * total
    async with BlockFileTier(
        namespace=NAMESPACE, path=path, min_free=0, capacity=capacity, concurrency=8
    ) as tier:
        return await batch_rates(tier, size, count, BATCH)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--size", default="256KiB")
    parser.add_argument("--mib", type=int, default=128, help="MiB written per case")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    size = parse_size(args.size, "--size")
    if args.dir is not None and not args.dir.is_dir():
        parser.error(f"--dir {args.dir}: not a directory")
    count = max(BATCH, (args.mib << 20) // size // BATCH * BATCH)
    rates: dict[str, list[tuple[float, float]]] = {case: [] for case in CASES}
    ratios: dict[str, list[tuple[float, float]]] = {case: [] for case in CASES}
    with tempfile.TemporaryDirectory(prefix="kvtier-file-shared-", dir=args.dir) as scratch:
        for r in range(args.repeat):
            got: dict[str, tuple[float, float]] = {}
            for case in CASES if r % 2 == 0 else reversed(CASES):
                path = Path(scratch) / f"{case}-{r}"
                got[case] = asyncio.run(one(case, path, size, count))
                shutil.rmtree(path, ignore_errors=True)
            for case in CASES:
                rates[case].append(got[case])
                base = got["unbounded"]
                ratios[case].append((got[case][0] / base[0], got[case][1] / base[1]))
    report: dict[str, Any] = {
        case: {
            "put_gib_s": statistics.median(p for p, _ in rates[case]),
            "get_gib_s": statistics.median(g for _, g in rates[case]),
            "put_ratio": statistics.median(p for p, _ in ratios[case]),
            "get_ratio": statistics.median(g for _, g in ratios[case]),
        }
        for case in CASES
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{count} blocks of {size} bytes per case, batches of {BATCH}, {args.repeat} repetitions")
    print(f"{'case':10} {'put GiB/s':>10} {'get GiB/s':>10} {'put ratio':>10} {'get ratio':>10}")
    for case, r in report.items():
        print(
            f"{case:10} {r['put_gib_s']:>10.2f} {r['get_gib_s']:>10.2f} "
            f"{r['put_ratio']:>10.2f} {r['get_ratio']:>10.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
