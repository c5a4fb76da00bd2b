"""CPU copy engine throughput against plain numpy copies of the same bytes, in the same run.

For each slot size, an engine KV cache (one tensor, a block per row) and a primary region in
/dev/shm are set up; `--total` bytes of randomly chosen blocks are stored into randomly chosen
slots in jobs of `--job-blocks` blocks, then loaded back into other blocks. Two baselines copy
exactly the same bytes in the same process:

- numpy per block: `np.copyto(slot, block)` for the same (block, slot) pairs, in the same order;
- numpy contiguous: one `np.copyto` of a contiguous buffer of the same total size (the memcpy
  ceiling, which no per-block copy reaches on these machines: glibc switches to non-temporal
  stores only for very large copies).

Ratios are engine throughput over baseline throughput; the best of `--repeat` runs of each,
interleaved.

    python bench/copy_engine.py [--sizes 16KiB,64KiB,256KiB,2MiB] [--total 256MiB] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tiering.units import parse_size  # noqa: E402
from tiers.copy import CpuCopyEngine, EngineBlocks, GroupRef, KVTensor  # noqa: E402
from tiers.region import DEFAULT_DIRECTORY, PrimaryRegion, RegionLayout  # noqa: E402


def best_seconds(run: Callable[[], None], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(
    slot_bytes: int, total: int, job_blocks: int, repeat: int, directory: Path
) -> dict[str, Any]:
    n = max(total // slot_bytes, job_blocks)
    rng = np.random.default_rng(0)
    engine_blocks = torch.empty((2 * n, slot_bytes), dtype=torch.uint8)
    engine_blocks.random_(0, 255)
    layout = RegionLayout(num_slots=2 * n, shard_bytes=slot_bytes)
    region = PrimaryRegion.create(f"bench-copy-{os.getpid()}", layout, directory)
    try:
        shard = region.shard_tensor(0)
        shard.fill_(1)  # fault every page in before timing, for the engine and the baselines
        engine = CpuCopyEngine(
            [KVTensor(engine_blocks, slot_bytes)], [[GroupRef(0, slot_bytes)]], shard
        )
        blocks = rng.permutation(2 * n)[:n]
        slots = rng.permutation(2 * n)[:n]
        targets = rng.permutation(2 * n)[:n]  # where loads put the blocks back
        jobs = range(0, n, job_blocks)
        job_id = iter(range(1 << 62))

        def store() -> None:
            ids = [next(job_id) for _ in jobs]
            for i, start in zip(ids, jobs, strict=True):
                engine.submit_store(
                    i,
                    EngineBlocks.of(
                        blocks[start : start + job_blocks],
                        [len(blocks[start : start + job_blocks])],
                        [0],
                    ),
                    slots[start : start + job_blocks],
                )
            engine.wait(ids)

        def load() -> None:
            ids = [next(job_id) for _ in jobs]
            for i, start in zip(ids, jobs, strict=True):
                engine.submit_load(
                    i,
                    slots[start : start + job_blocks],
                    EngineBlocks.of(
                        targets[start : start + job_blocks],
                        [len(targets[start : start + job_blocks])],
                        [0],
                    ),
                )
            engine.wait(ids)

        src_np, dst_np = engine_blocks.numpy(), region.shard(0)
        pairs = list(zip(blocks.tolist(), slots.tolist(), strict=True))

        def numpy_per_block() -> None:
            for b, s in pairs:
                np.copyto(dst_np[s], src_np[b])

        flat_src = src_np[:n].reshape(-1)
        flat_dst = np.empty_like(flat_src)
        flat_dst.fill(1)

        def numpy_contiguous() -> None:
            np.copyto(flat_dst, flat_src)

        times: dict[str, list[float]] = {
            k: [] for k in ("store", "load", "per_block", "contiguous")
        }
        for _ in range(repeat):  # interleaved, so that a noisy moment hits every variant
            times["per_block"].append(best_seconds(numpy_per_block, 1))
            times["contiguous"].append(best_seconds(numpy_contiguous, 1))
            times["store"].append(best_seconds(store, 1))
            times["load"].append(best_seconds(load, 1))
        results = engine.get_finished()
        assert all(r.ok for r in results), "a benchmark copy failed"
        engine.shutdown()
    finally:
        region.close()
    moved = n * slot_bytes
    gib = {k: moved / min(v) / 2**30 for k, v in times.items()}
    return {
        "slot_bytes": slot_bytes,
        "blocks": n,
        "job_blocks": job_blocks,
        "gib_s": gib,
        "store_vs_per_block": gib["store"] / gib["per_block"],
        "load_vs_per_block": gib["load"] / gib["per_block"],
        "store_vs_contiguous": gib["store"] / gib["contiguous"],
        "load_vs_contiguous": gib["load"] / gib["contiguous"],
    }


def contention(jobs: int = 20) -> dict[str, float]:
    """Mean job time (ms) of 32-piece jobs while another thread runs pure Python, as vLLM's
    main thread does between kernels: one GIL hand-off per job (the compiled helper) against
    one per piece (the fallback)."""
    import threading

    import tiers.copy.cpu as cpu

    page = 16 << 10
    tensors = [KVTensor(torch.zeros((256, page), dtype=torch.uint8), page) for _ in range(4)]
    shard = torch.zeros((256, 4 * page), dtype=torch.uint8)
    refs = [[GroupRef(t, page) for t in range(4)]]
    helper = cpu._copy_batch
    out = {}
    for name, batch in (("helper", helper), ("per_piece", None)):
        cpu._copy_batch = batch
        engine = CpuCopyEngine(tensors, refs, shard)
        stop = threading.Event()

        def spin(stop: threading.Event = stop) -> None:
            while not stop.is_set():
                sum(range(100))

        spinner = threading.Thread(target=spin)
        spinner.start()
        for job in range(jobs):
            rows = [(job * 8 + i) % 256 for i in range(8)]
            engine.submit_store(job, EngineBlocks.of(rows, [8], [0]), rows)
        engine.wait(range(jobs))
        stop.set()
        spinner.join()
        results = engine.get_finished()
        out[name] = 1e3 * sum(r.seconds for r in results) / len(results)
        engine.shutdown()
    cpu._copy_batch = helper
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="16KiB,64KiB,256KiB,2MiB")
    parser.add_argument("--total", default="256MiB", help="bytes moved per run and direction")
    parser.add_argument("--job-blocks", type=int, default=32, help="blocks per copy job")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="region directory (/dev/shm)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    directory = args.dir or (
        DEFAULT_DIRECTORY if DEFAULT_DIRECTORY.is_dir() else Path(tempfile.gettempdir())
    )
    sizes = [parse_size(s, "--sizes") for s in args.sizes.split(",")]
    total = parse_size(args.total, "--total")
    rows = [measure(size, total, args.job_blocks, args.repeat, directory) for size in sizes]
    busy = contention()
    if args.json:
        report = {"torch_threads": torch.get_num_threads(), "results": rows, "contention_ms": busy}
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"CPU copy engine vs numpy, best of {args.repeat}, GiB/s "
        "(ratio to numpy per block | to one contiguous numpy copy)"
    )
    print(
        f"{'slot':>8}  {'numpy/blk':>9}  {'contig':>6}  "
        f"{'store':>5} {'ratio':>12}  {'load':>5} {'ratio':>12}"
    )
    for r in rows:
        g = r["gib_s"]
        print(
            f"{r['slot_bytes'] // 1024:>5}KiB  {g['per_block']:>9.2f}  {g['contiguous']:>6.2f}  "
            f"{g['store']:>5.2f} {r['store_vs_per_block']:>5.2f} | {r['store_vs_contiguous']:.2f}  "
            f"{g['load']:>5.2f} {r['load_vs_per_block']:>5.2f} | {r['load_vs_contiguous']:.2f}"
        )
    print(
        f"32-piece job while another thread runs Python: {busy['helper']:.2f} ms with the "
        f"compiled helper, {busy['per_piece']:.2f} ms with a memmove per piece"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
