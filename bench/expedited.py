"""Expedited loads against regular loads behind a backlog of copies, in the same run.

vLLM 0.33 waits for an expedited load inside the step, before the forward pass, so its latency
is the step's. A copy engine serves it in a lane of its own (`tiers/copy/base.py`). Here a
backlog of `--backlog` bytes of stores, each followed by a load of the same blocks back (jobs
of `--job-blocks` blocks of `--block` bytes: the CPU engine's one regular lane, and both CUDA
streams, busy), is submitted, then at once one load of `--load-blocks` other blocks, regular or
expedited; the time from
the load's submission until `wait` returns is measured. Baseline: the same load on an idle
engine. Each case is run `--repeat` times, interleaved, and the median taken.

    python bench/expedited.py [--device cpu|cuda|fake] [--backlog 256MiB] [--json] [--out FILE]

`--device fake`: the CUDA engine on the fake CUDA layer of the tests (checks the benchmark on a
CPU; its timings mean nothing). Every round's copies are checked byte for byte (`verified`):
the backlog's blocks change before each round, so a load that overtook its store would bring
back the previous round's bytes.

Reported: the median milliseconds of each case, and the ratios regular / idle and
expedited / idle (target for expedited: at most 2 on the CPU engine, whose lanes share the
machine's cores and memory bandwidth with the backlog; at most 1.5 on CUDA, whose lanes are
separate streams and copy engines).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # first: bench/tiering.py would shadow the package

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tiering.units import parse_size  # noqa: E402
from tiers.copy import CopyEngine, CpuCopyEngine, EngineBlocks, GroupRef, KVTensor  # noqa: E402
from tiers.region import DEFAULT_DIRECTORY, PrimaryRegion, RegionLayout  # noqa: E402


def region_dir(size: int) -> Path:
    if DEFAULT_DIRECTORY.is_dir():
        stat = os.statvfs(DEFAULT_DIRECTORY)
        if stat.f_bavail * stat.f_frsize > 2 * size:
            return DEFAULT_DIRECTORY
    return Path(tempfile.gettempdir())


def measure(
    device: str, block: int, backlog: int, job_blocks: int, load_blocks: int, repeat: int
) -> dict[str, Any]:
    backlog_blocks = max(backlog // block, job_blocks)
    num_blocks = backlog_blocks + 2 * load_blocks
    num_slots = backlog_blocks + load_blocks
    engine_kv = torch.empty((num_blocks, block), dtype=torch.uint8)
    engine_kv.random_(0, 255)
    if device == "cuda":
        engine_kv = engine_kv.cuda()
    layout = RegionLayout(num_slots=num_slots, shard_bytes=block)
    directory = region_dir(num_slots * block)
    region = PrimaryRegion.create(f"bench-expedited-{os.getpid()}", layout, directory)
    fake: Any = None
    pinned = False
    try:
        shard = region.shard_tensor(0)
        shard.fill_(1)  # fault the pages in before timing
        engine: CopyEngine
        if device in ("cuda", "fake"):
            from tiers.copy.cuda import CudaCopyEngine

            if device == "fake":
                from tests.helpers.fake_cuda import FakeCuda

                fake = FakeCuda()
            pinned = region.pin(driver=None if fake is None else fake.driver)
            engine = CudaCopyEngine(
                [KVTensor(engine_kv, block)],
                [[GroupRef(0, block)]],
                shard,
                pinned=pinned,
                cuda=fake,
            )
        else:
            engine = CpuCopyEngine([KVTensor(engine_kv, block)], [[GroupRef(0, block)]], shard)
        ids = iter(range(1 << 62))
        load_slots = np.arange(backlog_blocks, backlog_blocks + load_blocks)
        load_into = EngineBlocks.of(
            np.arange(backlog_blocks, backlog_blocks + load_blocks), [load_blocks], [0]
        )
        first = next(ids)  # the load's slots hold a block before any timing
        engine.submit_store(first, load_into, load_slots)
        engine.wait([first])
        target = EngineBlocks.of(
            np.arange(backlog_blocks + load_blocks, num_blocks), [load_blocks], [0]
        )

        verified = True
        expected_load = engine_kv[backlog_blocks : backlog_blocks + load_blocks].clone()

        def one(behind: bool, expedited: bool) -> float:
            nonlocal verified
            queued = []
            if behind:
                engine_kv[:backlog_blocks].add_(1)  # new bytes each round (on the compute stream)
                expected = engine_kv[:backlog_blocks].clone()
                for start in range(0, backlog_blocks, job_blocks):
                    rows = np.arange(start, min(start + job_blocks, backlog_blocks))
                    blocks = EngineBlocks.of(rows, [len(rows)], [0])
                    store, load = next(ids), next(ids)
                    engine.submit_store(store, blocks, rows)
                    engine.submit_load(load, rows, blocks)  # the same bytes back
                    queued += [store, load]
            load = next(ids)
            start = time.perf_counter()
            engine.submit_load(load, load_slots, target, expedited=expedited)
            engine.wait([load])
            seconds = time.perf_counter() - start
            engine.wait(queued)
            results = engine.get_finished()
            verified = verified and all(r.ok for r in results)
            verified = verified and bool(
                torch.equal(engine_kv[num_blocks - load_blocks :], expected_load)
            )
            if behind:
                verified = verified and bool(torch.equal(engine_kv[:backlog_blocks], expected))
            engine_kv[num_blocks - load_blocks :].zero_()  # the next load must bring them back
            return seconds

        cases = {"idle": (False, False), "regular": (True, False), "expedited": (True, True)}
        samples: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(repeat):
            for name, (behind, expedited) in cases.items():
                samples[name].append(one(behind, expedited))
        engine.shutdown()
    finally:
        region.close()
        if fake is not None:
            fake.close()
    ms = {name: statistics.median(values) * 1e3 for name, values in samples.items()}
    return {
        "device": device,
        "pinned": pinned,
        "region_dir": str(directory),
        "verified": verified,
        "block_bytes": block,
        "backlog_bytes": backlog_blocks * block,
        "load_blocks": load_blocks,
        "idle_ms": ms["idle"],
        "regular_ms": ms["regular"],
        "expedited_ms": ms["expedited"],
        "regular_ratio": ms["regular"] / ms["idle"],
        "expedited_ratio": ms["expedited"] / ms["idle"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda", "fake"], default="cpu")
    parser.add_argument("--block", default="256KiB", help="bytes per block (default 256KiB)")
    parser.add_argument("--backlog", default="256MiB", help="bytes copied ahead (256MiB)")
    parser.add_argument("--job-blocks", type=int, default=32, help="blocks per store job (32)")
    parser.add_argument("--load-blocks", type=int, default=16, help="blocks of the load (16)")
    parser.add_argument("--repeat", type=int, default=5, help="runs of each case (5)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--out", type=Path, help="append the result as a JSON line")
    args = parser.parse_args()
    result = measure(
        args.device,
        parse_size(args.block, "--block"),
        parse_size(args.backlog, "--backlog"),
        args.job_blocks,
        args.load_blocks,
        args.repeat,
    )
    if args.out is not None:
        with args.out.open("a") as f:
            f.write(json.dumps({"kind": "expedited", **result}) + "\n")
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"{args.device}: a load of {result['load_blocks']} blocks of {result['block_bytes'] >> 10}"
        f" KiB behind {result['backlog_bytes'] >> 20} MiB of stores and loads"
    )
    print(f"  idle engine  {result['idle_ms']:8.2f} ms")
    print(f"  regular      {result['regular_ms']:8.2f} ms  ({result['regular_ratio']:.1f}x idle)")
    print(
        f"  expedited    {result['expedited_ms']:8.2f} ms  ({result['expedited_ratio']:.1f}x idle)"
    )


if __name__ == "__main__":
    main()
