"""CUDA copy engine against one large pinned cudaMemcpyAsync, in the same run (needs a GPU).

1. Throughput by block size: `--total` bytes of randomly placed GPU blocks stored into a pinned
   primary region and loaded back, in jobs of `--job-blocks`, against one `copy_` of the same
   number of bytes between a GPU tensor and a pinned host tensor (a single cudaMemcpyAsync).
   Target: at least 0.9 of it for blocks of 2 MiB and more.
2. Per-piece cost of small pieces (4-32 KiB): one job of `--pieces` pieces through the batched
   path (cuMemcpyBatchAsync) and through the per-piece path (a cuMemcpyAsync each), wall time
   from submit to finish divided by the pieces. Target: at most 1.2 us per piece batched, and
   at least 3.5 times better than per piece.

    python bench/gpu_copy.py [--json]      # scripts/gpu_check.sh runs it
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tiering.units import parse_size  # noqa: E402
from tiers.copy import EngineBlocks, GroupRef, KVTensor  # noqa: E402
from tiers.copy.cuda import CudaCopyEngine  # noqa: E402
from tiers.region import DEFAULT_DIRECTORY, PrimaryRegion, RegionLayout  # noqa: E402


def region_dir(size: int) -> Path:
    if (
        DEFAULT_DIRECTORY.is_dir()
        and os.statvfs(DEFAULT_DIRECTORY).f_bavail * os.statvfs(DEFAULT_DIRECTORY).f_frsize
        > 2 * size
    ):
        return DEFAULT_DIRECTORY
    return Path(tempfile.gettempdir())


def run_jobs(
    engine: CudaCopyEngine,
    store: bool,
    blocks: np.ndarray,
    slots: np.ndarray,
    per_job: int,
    first_id: int,
) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    ids = []
    for i, at in enumerate(range(0, len(blocks), per_job)):
        job = first_id + i
        ids.append(job)
        b = EngineBlocks.of(blocks[at : at + per_job], [len(blocks[at : at + per_job])], [0])
        if store:
            engine.submit_store(job, b, slots[at : at + per_job])
        else:
            engine.submit_load(job, slots[at : at + per_job], b)
    engine.wait(ids)
    elapsed = time.perf_counter() - start
    results = engine.get_finished()
    assert len(results) == len(ids) and all(r.ok for r in results), results[:3]
    return elapsed


def throughput(block: int, total: int, per_job: int, repeat: int) -> dict[str, Any]:
    n = max(total // block, per_job)
    gpu = torch.empty((2 * n, block), dtype=torch.uint8, device="cuda")
    gpu.random_(0, 255)
    layout = RegionLayout(num_slots=2 * n, shard_bytes=block)
    region = PrimaryRegion.create(f"bench-gpu-{os.getpid()}", layout, region_dir(layout.file_size))
    try:
        shard = region.shard_tensor(0)
        shard.fill_(1)
        assert region.pin(), "cudaHostRegister failed"
        engine = CudaCopyEngine([KVTensor(gpu, block)], [[GroupRef(0, block)]], shard)
        rng = np.random.default_rng(0)
        blocks, slots = rng.permutation(2 * n)[:n], rng.permutation(2 * n)[:n]
        flat_gpu = gpu[:n].reshape(-1)
        flat_host = torch.empty(n * block, dtype=torch.uint8).pin_memory()
        best = {"store": 1e9, "load": 1e9, "d2h": 1e9, "h2d": 1e9}
        next_id = 0
        for _ in range(repeat):
            for name, src, dst in (("d2h", flat_gpu, flat_host), ("h2d", flat_host, flat_gpu)):
                torch.cuda.synchronize()
                t = time.perf_counter()
                dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize()
                best[name] = min(best[name], time.perf_counter() - t)
            best["store"] = min(
                best["store"], run_jobs(engine, True, blocks, slots, per_job, next_id)
            )
            next_id += 1 << 20
            best["load"] = min(
                best["load"], run_jobs(engine, False, blocks, slots, per_job, next_id)
            )
            next_id += 1 << 20
        batched = engine.batched
        engine.shutdown()
        del shard, engine
    finally:
        region.close()
    gib = {k: n * block / v / 2**30 for k, v in best.items()}
    return {
        "block_bytes": block,
        "blocks": n,
        "batched": batched,
        "gib_s": gib,
        "store_ratio": gib["store"] / gib["d2h"],
        "load_ratio": gib["load"] / gib["h2d"],
    }


def per_piece(piece: int, pieces: int, repeat: int) -> dict[str, Any]:
    gpu = torch.empty((2 * pieces, piece), dtype=torch.uint8, device="cuda")
    host = torch.zeros((2 * pieces, piece), dtype=torch.uint8).pin_memory()
    rng = np.random.default_rng(1)
    blocks, slots = rng.permutation(2 * pieces)[:pieces], rng.permutation(2 * pieces)[:pieces]
    out: dict[str, Any] = {"piece_bytes": piece, "pieces": pieces}
    for batch in (True, False):
        engine = CudaCopyEngine([KVTensor(gpu, piece)], [[GroupRef(0, piece)]], host, batch=batch)
        if batch and not engine.batched:
            out["batched_unavailable"] = True
        best = 1e9
        for r in range(repeat):
            best = min(best, run_jobs(engine, r % 2 == 0, blocks, slots, pieces, r * 10))
        out["batched_us" if batch else "per_piece_us"] = best / pieces * 1e6
        engine.shutdown()
    out["speedup"] = out["per_piece_us"] / out["batched_us"]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="256KiB,2MiB,8MiB")
    parser.add_argument("--total", default="1GiB")
    parser.add_argument("--job-blocks", type=int, default=16)
    parser.add_argument("--piece-sizes", default="4KiB,8KiB,16KiB,32KiB")
    parser.add_argument("--pieces", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gpu_copy.py needs CUDA", file=sys.stderr)
        return 2
    total = parse_size(args.total, "--total")
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "throughput": [
            throughput(parse_size(s, "--sizes"), total, args.job_blocks, args.repeat)
            for s in args.sizes.split(",")
        ],
        "per_piece": [
            per_piece(parse_size(s, "--piece-sizes"), args.pieces, args.repeat)
            for s in args.piece_sizes.split(",")
        ],
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{report['device']}, torch {report['torch']}")
    for r in report["throughput"]:
        g = r["gib_s"]
        print(
            f"block {r['block_bytes'] >> 10:>6} KiB: store {g['store']:.1f} GiB/s "
            f"({r['store_ratio']:.2f} of one d2h memcpy {g['d2h']:.1f}), load {g['load']:.1f} "
            f"({r['load_ratio']:.2f} of one h2d memcpy {g['h2d']:.1f}), batched={r['batched']}"
        )
    for r in report["per_piece"]:
        print(
            f"piece {r['piece_bytes'] >> 10:>3} KiB x {r['pieces']}: batched "
            f"{r['batched_us']:.2f} us/piece, per-piece {r['per_piece_us']:.2f} us/piece "
            f"({r['speedup']:.1f}x)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
