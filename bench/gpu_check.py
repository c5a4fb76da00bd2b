"""The facts and the summary of `scripts/gpu_check.sh`.

    python bench/gpu_check.py facts [--fake] --out FILE   # what explains the numbers
    python bench/gpu_check.py summary OUT_DIR             # OUT_DIR/summary.json

`facts`: torch, CUDA and driver versions, the GPU, which batch-copy entry point libcuda has,
/dev/shm's size. `summary`: every target beside its figure, from the stages' JSON lines
(`bench/gpu_copy.py --out`, `bench/expedited.py --out`, `bench/vllm_worker.py --out`), with the
stages' exit statuses, vLLM 0.34's worker path (`worker_path`), whether every timed copy was
verified, and the fallbacks taken. A target whose stage gave no figure is
listed with `figure: null` and the stage's status, never left out. Exits 1 when a stage failed
or a copy's bytes were wrong; a missed target is a figure, not a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # first: bench/tiering.py would shadow the package

MIB = 1 << 20
TARGETS = {
    "store_ratio": (">=", 0.9, "store throughput / one pinned cudaMemcpy D2H of the same bytes"),
    "load_ratio": (">=", 0.9, "load throughput / one pinned cudaMemcpy H2D of the same bytes"),
    "batched_submit_us": ("<=", 1.2, "batched submission, microseconds per piece"),
    "speedup": (">=", 3.5, "per-piece submission / batched submission"),
    "expedited_ratio": ("<=", 1.5, "expedited load behind a backlog / the same load idle"),
}


def facts(fake: bool) -> dict[str, Any]:
    import numpy as np
    import torch

    out: dict[str, Any] = {
        "fake_cuda": fake,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "torch_cuda": torch.version.cuda,
    }
    if fake:
        from tests.helpers.fake_cuda import FakeCuda

        cuda = FakeCuda()
        out["gpu"] = "the fake CUDA layer (tests/helpers/fake_cuda.py) on a CPU"
        out["batch_symbol"] = cuda.driver.batch_symbol
        cuda.close()
    else:
        out["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name()
            out["driver_cuda_version"] = torch._C._cuda_getDriverVersion()
        try:
            from tiers.copy.cuda_driver import CudaDriver

            out["batch_symbol"] = CudaDriver().batch_symbol
        except OSError as e:
            out["batch_symbol"] = None
            out["libcuda_error"] = str(e)
        smi = shutil.which("nvidia-smi")
        if smi is not None:
            query = "--query-gpu=name,driver_version,memory.total,pcie.link.gen.current"
            try:
                done = subprocess.run(
                    [smi, query, "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=15,
                )
                out["nvidia_smi"] = done.stdout.strip() or done.stderr.strip()
            except subprocess.TimeoutExpired:
                out["nvidia_smi"] = "timed out"
    shm = Path("/dev/shm")
    if shm.is_dir():
        stat = os.statvfs(shm)
        out["dev_shm_bytes"] = stat.f_blocks * stat.f_frsize
        out["dev_shm_free_bytes"] = stat.f_bavail * stat.f_frsize
    else:
        out["dev_shm_bytes"] = None
    return out


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _target(
    name: str, key: str, record: dict[str, Any] | None, why_missing: str, **beside: Any
) -> dict[str, Any]:
    op, bound, what = TARGETS[key]
    figure = None if record is None else record.get(key)
    met = None
    if figure is not None:
        met = figure >= bound if op == ">=" else figure <= bound
    entry: dict[str, Any] = {
        "name": name,
        "what": what,
        "figure": figure,
        "target": f"{op} {bound}",
    }
    entry["met"] = met
    if record is None:
        entry["missing"] = why_missing
    else:
        entry["verified"] = record.get("verified")
        entry.update({k: record.get(k, v) for k, v in beside.items()})
    return entry


def summary(out_dir: Path) -> tuple[dict[str, Any], bool]:
    stages: dict[str, int] = {}
    stages_file = out_dir / "stages.txt"
    if stages_file.exists():
        for line in stages_file.read_text().splitlines():
            name, _, rc = line.partition(" ")
            stages[name] = int(rc)
    facts_file = out_dir / "facts.json"
    found = json.loads(facts_file.read_text()) if facts_file.exists() else None
    copies = _lines(out_dir / "gpu-copy.jsonl")
    expedited = _lines(out_dir / "expedited.jsonl")
    workers = _lines(out_dir / "vllm-worker.jsonl")

    def missing(stage: str) -> str:
        rc = stages.get(stage)
        return f"stage {stage} did not run" if rc is None else f"stage {stage} exit status {rc}"

    targets = []
    big = [r for r in copies if r["kind"] == "throughput" and r["block_bytes"] >= 2 * MIB]
    for key, side in (("store_ratio", "store"), ("load_ratio", "load")):
        for r in big or [None]:
            label = "?" if r is None else f"{r['block_bytes'] // MIB} MiB"
            beside = {"pinned": None, "batched": None, "region_dir": None}
            targets.append(
                _target(f"{side}, {label} blocks", key, r, missing("gpu_copy"), **beside)
            )
    pieces = [r for r in copies if r["kind"] == "per_piece"]
    for key in ("batched_submit_us", "speedup"):
        for r in pieces or [None]:
            label = "?" if r is None else f"{r['piece_bytes'] >> 10} KiB"
            targets.append(
                _target(f"{key}, {label} pieces", key, r, missing("gpu_copy"), batched=None)
            )
    for r in expedited[-1:] or [None]:
        targets.append(
            _target(
                "expedited load behind a backlog",
                "expedited_ratio",
                r,
                missing("expedited"),
                pinned=None,
                idle_ms=None,
                expedited_ms=None,
                regular_ratio=None,
            )
        )
    fallbacks = []
    for r in copies + expedited:
        where = r["kind"] + (f" {r['block_bytes']} B" if "block_bytes" in r else "")
        if r.get("pinned") is False:
            fallbacks.append(f"{where}: region not pinned (pageable copies)")
        if r.get("batched") is False:
            fallbacks.append(f"{where}: per-piece copies (no batch call, or its self-check failed)")
        if r.get("region_dir") not in (None, "/dev/shm"):
            fallbacks.append(f"{where}: region in {r['region_dir']}, not /dev/shm (too small)")
    wrong = [r for r in copies + expedited + workers if r.get("verified") is not True]
    wrong += [r for r in workers if r.get("stray_pointer_failed") is not True]
    ok = (
        all(rc == 0 for rc in stages.values())
        and not wrong
        and bool(copies)
        and bool(expedited)
        and bool(workers)
    )
    worker = workers[-1] if workers else {"missing": missing("vllm_worker")}
    report = {
        "ok": ok,
        "stages": stages,
        "facts": found,
        "targets": targets,
        "all_copies_verified": not wrong and bool(copies + expedited + workers),
        "worker_path": worker,
        "fallbacks": sorted(set(fallbacks)),
        "measurements": {"gpu_copy": copies, "expedited": expedited, "vllm_worker": workers},
    }
    return report, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    f = sub.add_parser("facts")
    f.add_argument("--fake", action="store_true")
    f.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("summary")
    s.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    if args.command == "facts":
        found = facts(args.fake)
        args.out.write_text(json.dumps(found, indent=2) + "\n")
        print(json.dumps(found, indent=2))
        return 0
    report, ok = summary(args.out_dir)
    (args.out_dir / "summary.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"stages: {report['stages']}")
    print(f"facts: {json.dumps(report['facts'])}")
    for t in report["targets"]:
        figure = "n/a" if t["figure"] is None else f"{t['figure']:.3g}"
        verdict = {True: "met", False: "MISSED", None: t.get("missing", "no figure")}[t["met"]]
        print(f"  {t['name']:<42} {figure:>8}  target {t['target']:<7} {verdict}")
    print(f"every timed copy verified: {report['all_copies_verified']}")
    for line in report["fallbacks"]:
        print(f"  fallback: {line}")
    print(f"summary: {args.out_dir / 'summary.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
