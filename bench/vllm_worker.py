"""vLLM 0.34's worker path on the CUDA copy engine: device pointers in, every byte checked.

vLLM 0.34's connector resolves a transfer's engine blocks to flat device pointers
(`vllm/v1/kv_offload/pointer_utils.py`, `resolve_device_pointers`) and hands them to the
worker's `submit_store` / `submit_load`. Here KV caches shaped as vLLM's canonical ones (per
layer an int8 `(num_blocks, page)` tensor on the device, one KV cache group referring to every
layer) are stored into a pinned primary region and loaded back into other engine blocks through
that path:

- pointers from vLLM 0.34's own `resolve_device_pointers` where vLLM is importable, else from
  the same formula here (`pointers_from` says which);
- the worker is kvtier's `KvtierWorker` where vLLM is importable, else the two calls it makes
  (`connectors.vllm.pointers.blocks_from_pointers`, then the engine's submit) (`worker`);
- after each store the region's slots, after each load the engine's blocks are compared with
  what they must hold (`verified`); a transfer with a stray pointer must be a failed job that
  changes no byte (`stray_pointer_failed`).

    python bench/vllm_worker.py [--device cuda|fake] [--blocks 64] [--page 64KiB] [--out FILE]

`--device fake`: the CUDA engine on the fake CUDA layer of the tests (checks this stage on a
CPU; its timings mean nothing).
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
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # first: bench/tiering.py would shadow the package

import numpy as np  # noqa: E402
import torch  # noqa: E402

from connectors.vllm.pointers import blocks_from_pointers  # noqa: E402
from tiering.units import parse_size  # noqa: E402
from tiers.copy import GroupRef, KVTensor  # noqa: E402
from tiers.region import DEFAULT_DIRECTORY, PrimaryRegion, RegionLayout  # noqa: E402

LAYERS = 4


def region_dir(size: int) -> Path:
    if DEFAULT_DIRECTORY.is_dir():
        stat = os.statvfs(DEFAULT_DIRECTORY)
        if stat.f_bavail * stat.f_frsize > 2 * size:
            return DEFAULT_DIRECTORY
    return Path(tempfile.gettempdir())


def resolver(tensors: list[KVTensor], groups: list[list[GroupRef]]) -> tuple[Any, str]:
    """`resolve(block_ids) -> DevicePointers` for one group, and where it comes from."""
    try:
        from vllm.v1.kv_offload.base import (
            CanonicalKVCacheRef,
            CanonicalKVCaches,
            CanonicalKVCacheTensor,
            GPULoadStoreSpec,
        )
        from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers
    except Exception:  # no vLLM 0.34 here: the same formula
        return _resolve_here(tensors, groups), "kvtier's equivalent (vLLM 0.34 not importable)"
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(kv.tensor, kv.page_bytes) for kv in tensors],
        group_data_refs=[
            [CanonicalKVCacheRef(ref.tensor_index, ref.nbytes) for ref in refs] for refs in groups
        ],
    )

    def resolve(block_ids: np.ndarray[Any, Any]) -> Any:
        spec = GPULoadStoreSpec(block_ids.tolist(), group_sizes=[len(block_ids)], block_indices=[0])
        return resolve_device_pointers(spec, caches)

    return resolve, "vllm.v1.kv_offload.pointer_utils.resolve_device_pointers"


def _resolve_here(tensors: list[KVTensor], groups: list[list[GroupRef]]) -> Any:
    def resolve(block_ids: np.ndarray[Any, Any]) -> Any:
        ptrs, sizes = [], []
        for ref in groups[0]:
            tensor = tensors[ref.tensor_index].tensor
            row = tensor.stride(0) * tensor.element_size()
            ptrs.append(tensor.data_ptr() + block_ids.astype(np.uint64) * np.uint64(row))
            sizes.append(np.full(len(block_ids), ref.nbytes, dtype=np.uint64))
        return SimpleNamespace(
            ptrs=np.concatenate(ptrs).astype(np.uint64),
            sizes=np.concatenate(sizes),
            group_block_counts=(len(block_ids),),
            group_data_ref_counts=(len(groups[0]),),
            block_indices=(0,),
        )

    return resolve


class _Calls:
    """What `KvtierWorker` does with a transfer, for where vLLM cannot be imported."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def submit_store(self, job_id: int, pointers: Any, dst: Any) -> bool:
        blocks, _ = blocks_from_pointers(pointers, self.engine.tensors, self.engine.groups)
        self.engine.submit_store(job_id, blocks, dst.block_ids)
        return True

    def submit_load(self, job_id: int, src: Any, pointers: Any, expedited: bool = False) -> bool:
        blocks, _ = blocks_from_pointers(pointers, self.engine.tensors, self.engine.groups)
        self.engine.submit_load(job_id, src.block_ids, blocks, expedited=expedited)
        return True

    def get_finished(self) -> list[Any]:
        return [SimpleNamespace(job_id=r.job_id, success=r.ok) for r in self.engine.get_finished()]

    def wait(self, job_ids: set[int]) -> None:
        self.engine.wait(job_ids)


def worker_over(engine: Any) -> tuple[Any, str]:
    try:
        from connectors.resources import Resources
        from connectors.vllm.worker import KvtierWorker
    except Exception:
        return _Calls(engine), "kvtier's adapter calls (vLLM not importable)"
    resources = Resources()
    return KvtierWorker(engine, resources), "connectors.vllm.worker.KvtierWorker"


def measure(device: str, num_blocks: int, page: int, repeat: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    host = [
        torch.randint(-128, 127, (2 * num_blocks, page), dtype=torch.int8, generator=gen)
        for _ in range(LAYERS)
    ]
    tensors = [KVTensor(t.cuda() if device == "cuda" else t, page) for t in host]
    groups = [[GroupRef(i, page) for i in range(LAYERS)]]
    layout = RegionLayout(num_slots=num_blocks, shard_bytes=LAYERS * page)
    directory = region_dir(num_blocks * LAYERS * page)
    region = PrimaryRegion.create(f"bench-vllm-worker-{os.getpid()}", layout, directory)
    fake: Any = None
    from tiers.copy.cuda import CudaCopyEngine

    if device == "fake":
        from tests.helpers.fake_cuda import FakeCuda

        fake = FakeCuda()
    try:
        shard = region.shard_tensor(0)
        shard.fill_(0)
        pinned = region.pin(driver=None if fake is None else fake.driver)
        engine = CudaCopyEngine(tensors, groups, shard, pinned=pinned, cuda=fake)
        worker, worker_kind = worker_over(engine)
        resolve, pointers_from = resolver(tensors, groups)
        rng = np.random.default_rng(0)
        ids = iter(range(1, 1 << 40))
        verified = True
        store_s: list[float] = []
        load_s: list[float] = []

        def run(job: int) -> bool:
            """Wait for `job`; whether it succeeded."""
            worker.wait({job})
            done = {r.job_id: r.success for r in worker.get_finished()}
            return bool(done.get(job))

        for _ in range(repeat):
            source = rng.permutation(num_blocks).astype(np.int64)  # the blocks to store
            slots = rng.permutation(num_blocks).astype(np.int64)
            target = (num_blocks + rng.permutation(num_blocks)).astype(np.int64)
            for t in tensors:
                t.tensor[torch.as_tensor(target)] = 0
            job = next(ids)
            start = time.perf_counter()
            worker.submit_store(job, resolve(source), SimpleNamespace(block_ids=slots))
            ok = run(job)
            store_s.append(time.perf_counter() - start)
            for layer, t in enumerate(tensors):
                held = shard[torch.as_tensor(slots), layer * page : (layer + 1) * page]
                verified = (
                    verified
                    and ok
                    and bool(
                        torch.equal(held, t.tensor[torch.as_tensor(source)].view(torch.uint8).cpu())
                    )
                )
            job = next(ids)
            start = time.perf_counter()
            worker.submit_load(job, SimpleNamespace(block_ids=slots), resolve(target))
            ok = run(job)
            load_s.append(time.perf_counter() - start)
            for t in tensors:
                verified = (
                    verified
                    and ok
                    and bool(
                        torch.equal(
                            t.tensor[torch.as_tensor(target)], t.tensor[torch.as_tensor(source)]
                        )
                    )
                )

        before = shard.clone()
        stray = resolve(np.arange(4, dtype=np.int64))
        stray.ptrs = stray.ptrs.copy()
        stray.ptrs[0] += np.uint64(1 << 40)  # far outside every KV tensor
        job = next(ids)
        worker.submit_store(job, stray, SimpleNamespace(block_ids=np.arange(4)))
        stray_failed = not run(job) and bool(torch.equal(shard, before))
        engine.shutdown()
    finally:
        region.close()
        if fake is not None:
            fake.close()
    nbytes = num_blocks * LAYERS * page
    return {
        "device": device,
        "pinned": pinned,
        "region_dir": str(directory),
        "pointers_from": pointers_from,
        "worker": worker_kind,
        "verified": verified,
        "stray_pointer_failed": stray_failed,
        "blocks": num_blocks,
        "page_bytes": page,
        "layers": LAYERS,
        "store_ms": statistics.median(store_s) * 1e3,
        "load_ms": statistics.median(load_s) * 1e3,
        "store_gbps": nbytes / statistics.median(store_s) / 1e9,
        "load_gbps": nbytes / statistics.median(load_s) / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "fake"], default="cuda")
    parser.add_argument("--blocks", type=int, default=64, help="blocks per transfer (64)")
    parser.add_argument("--page", default="64KiB", help="bytes per block and layer (64KiB)")
    parser.add_argument("--repeat", type=int, default=5, help="store/load rounds (5)")
    parser.add_argument("--out", type=Path, help="append the result as a JSON line")
    args = parser.parse_args()
    result = measure(args.device, args.blocks, parse_size(args.page, "--page"), args.repeat)
    if args.out is not None:
        with args.out.open("a") as f:
            f.write(json.dumps({"kind": "vllm_worker", **result}) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
