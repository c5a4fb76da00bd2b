"""CUDA copy engine against one large pinned cudaMemcpyAsync, in the same run (needs a GPU, or
`--fake` for the fake CUDA layer of the tests, which checks the benchmark itself on a CPU).

1. Throughput by block size: `--total` bytes of randomly placed GPU blocks stored into a pinned
   primary region and loaded back, in jobs of `--job-blocks`, against one `copy_` of the same
   number of bytes between a GPU tensor and a pinned host tensor (a single cudaMemcpyAsync).
   Target: at least 0.9 of it for blocks of 2 MiB and more.
2. Submission cost of small pieces (4-32 KiB): one store job of `--pieces` pieces through the
   batched path (cuMemcpyBatchAsync) and through the per-piece path (a cuMemcpyAsync each): the
   time spent in `submit_store` divided by the pieces (the copies themselves are the DMA's),
   and, for reference, submit to finish. Target: at most 1.2 us per piece batched, and at
   least 3.5 times less than per piece.

Every timed copy is checked byte for byte afterwards (`verified`). What explains the numbers is
reported beside them: the region's directory, whether it is pinned, whether the engine batches.
Each measurement is written as one JSON line as soon as it is done (`--out`), so a run cut short
keeps what it measured.

    python bench/gpu_copy.py [--fake] [--out FILE]      # scripts/gpu_check.sh runs it
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
sys.path.insert(0, str(ROOT))  # first: bench/tiering.py would shadow the package

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tiering.units import parse_size  # noqa: E402
from tiers.copy import EngineBlocks, GroupRef, KVTensor  # noqa: E402
from tiers.copy.cuda import CudaCopyEngine  # noqa: E402
from tiers.region import DEFAULT_DIRECTORY, PrimaryRegion, RegionLayout  # noqa: E402


class Device:
    """The GPU, or the fake CUDA layer (`--fake`): where tensors go, how to wait for them."""

    def __init__(self, fake: bool) -> None:
        self.fake: Any = None
        if fake:
            from tests.helpers.fake_cuda import FakeCuda

            self.fake = FakeCuda()

    def empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.uint8, device="cpu" if self.fake else "cuda")

    def pinned(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.fake is not None:
            host = torch.zeros(shape, dtype=torch.uint8)
            self.fake.pin(host)
            return host
        return torch.zeros(shape, dtype=torch.uint8).pin_memory()

    def sync(self) -> None:
        if self.fake is not None:
            self.fake.synchronize()
        else:
            torch.cuda.synchronize()

    def engine(self, gpu: torch.Tensor, shard: torch.Tensor, **kw: Any) -> CudaCopyEngine:
        block = gpu.shape[1]
        return CudaCopyEngine(
            [KVTensor(gpu, block)], [[GroupRef(0, block)]], shard, cuda=self.fake, **kw
        )

    def pin(self, region: PrimaryRegion) -> bool:
        return region.pin(driver=None if self.fake is None else self.fake.driver)


def region_dir(size: int) -> Path:
    """/dev/shm (production's directory) when it has room for twice the region, else /tmp."""
    if DEFAULT_DIRECTORY.is_dir():
        stat = os.statvfs(DEFAULT_DIRECTORY)
        if stat.f_bavail * stat.f_frsize > 2 * size:
            return DEFAULT_DIRECTORY
    return Path(tempfile.gettempdir())


def run_jobs(
    engine: CudaCopyEngine,
    store: bool,
    blocks: np.ndarray,
    slots: np.ndarray,
    per_job: int,
    first_id: int,
    sync: Callable[[], None],
) -> float:
    sync()
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
    failed = [r for r in results if not r.ok]
    if len(results) != len(ids) or failed:
        raise RuntimeError(f"{len(failed)} of {len(ids)} copy jobs failed: {failed[:2]}")
    return elapsed


def same(gpu: torch.Tensor, blocks: torch.Tensor, shard: torch.Tensor, slots: torch.Tensor) -> bool:
    """Whether GPU rows `blocks` hold the bytes of shard rows `slots`."""
    return bool(torch.equal(gpu[blocks.to(gpu.device)], shard[slots].to(gpu.device)))


def throughput(dev: Device, block: int, total: int, per_job: int, repeat: int) -> dict[str, Any]:
    n = max(total // block, per_job)
    gpu = dev.empty((2 * n, block))
    gpu.random_(0, 255)
    layout = RegionLayout(num_slots=2 * n, shard_bytes=block)
    directory = region_dir(layout.file_size)
    region = PrimaryRegion.create(f"bench-gpu-{os.getpid()}", layout, directory)
    try:
        shard = region.shard_tensor(0)
        shard.fill_(1)
        pinned = dev.pin(region)
        engine = dev.engine(gpu, shard, pinned=pinned)
        rng = np.random.default_rng(0)
        blocks, slots = rng.permutation(2 * n)[:n], rng.permutation(2 * n)[:n]
        blocks_t, slots_t = torch.from_numpy(blocks), torch.from_numpy(slots)
        flat_gpu = gpu[:n].reshape(-1)
        flat_host = dev.pinned((n * block,))
        best = {"store": 1e9, "load": 1e9, "d2h": 1e9, "h2d": 1e9}
        verified = True
        next_id = 0
        for _ in range(repeat):
            for name, src, dst in (("d2h", flat_gpu, flat_host), ("h2d", flat_host, flat_gpu)):
                dev.sync()
                t = time.perf_counter()
                dst.copy_(src, non_blocking=True)
                dev.sync()
                best[name] = min(best[name], time.perf_counter() - t)
            seconds = run_jobs(engine, True, blocks, slots, per_job, next_id, dev.sync)
            best["store"] = min(best["store"], seconds)
            verified = verified and same(gpu, blocks_t, shard, slots_t)
            expected = gpu[blocks_t.to(gpu.device)].clone()
            gpu[blocks_t.to(gpu.device)] = 0  # a load that copies nothing is caught
            dev.sync()
            next_id += 1 << 20
            seconds = run_jobs(engine, False, blocks, slots, per_job, next_id, dev.sync)
            best["load"] = min(best["load"], seconds)
            verified = verified and bool(torch.equal(gpu[blocks_t.to(gpu.device)], expected))
            next_id += 1 << 20
        batched = engine.batched
        engine.shutdown()
        del shard, engine
    finally:
        region.close()
    gib = {k: n * block / v / 2**30 for k, v in best.items()}
    return {
        "kind": "throughput",
        "block_bytes": block,
        "blocks": n,
        "batched": batched,
        "pinned": pinned,
        "region_dir": str(directory),
        "verified": verified,
        "gib_s": gib,
        "store_ratio": gib["store"] / gib["d2h"],
        "load_ratio": gib["load"] / gib["h2d"],
    }


def per_piece(dev: Device, piece: int, pieces: int, repeat: int) -> dict[str, Any]:
    gpu = dev.empty((2 * pieces, piece))
    gpu.random_(0, 255)
    host = dev.pinned((2 * pieces, piece))
    rng = np.random.default_rng(1)
    blocks, slots = rng.permutation(2 * pieces)[:pieces], rng.permutation(2 * pieces)[:pieces]
    blocks_t, slots_t = torch.from_numpy(blocks), torch.from_numpy(slots)
    out: dict[str, Any] = {"kind": "per_piece", "piece_bytes": piece, "pieces": pieces}
    verified = True
    for batch in (True, False):
        engine = dev.engine(gpu, host, batch=batch)
        name = "batched" if batch else "per_piece"
        if batch:
            out["batched"] = engine.batched
        submit = total = 1e9
        for r in range(repeat):
            host.zero_()
            dev.sync()
            start = time.perf_counter()
            engine.submit_store(r, EngineBlocks.of(blocks, [pieces], [0]), slots)
            submitted = time.perf_counter()
            engine.wait([r])
            done = time.perf_counter()
            (result,) = engine.get_finished()
            verified = verified and result.ok and same(gpu, blocks_t, host, slots_t)
            submit, total = min(submit, submitted - start), min(total, done - start)
        out[f"{name}_submit_us"] = submit / pieces * 1e6
        out[f"{name}_total_us"] = total / pieces * 1e6
        engine.shutdown()
    out["verified"] = verified
    out["speedup"] = out["per_piece_submit_us"] / out["batched_submit_us"]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="256KiB,2MiB,8MiB")
    parser.add_argument("--total", default="1GiB")
    parser.add_argument("--job-blocks", type=int, default=16)
    parser.add_argument("--piece-sizes", default="4KiB,8KiB,16KiB,32KiB")
    parser.add_argument("--pieces", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--fake", action="store_true", help="on the fake CUDA layer (a CPU)")
    parser.add_argument("--out", type=Path, help="append each measurement as a JSON line")
    args = parser.parse_args(argv)
    if not args.fake and not torch.cuda.is_available():
        print("bench/gpu_copy.py needs CUDA (or --fake)", file=sys.stderr)
        return 2
    dev = Device(args.fake)
    total = parse_size(args.total, "--total")

    def emit(record: dict[str, Any]) -> None:
        print(json.dumps(record), flush=True)
        if args.out is not None:
            with args.out.open("a") as f:
                f.write(json.dumps(record) + "\n")

    try:
        for s in args.sizes.split(","):
            emit(throughput(dev, parse_size(s, "--sizes"), total, args.job_blocks, args.repeat))
        for s in args.piece_sizes.split(","):
            emit(per_piece(dev, parse_size(s, "--piece-sizes"), args.pieces, args.repeat))
    finally:
        if dev.fake is not None:
            dev.fake.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
