"""The benchmarks run (their figures live in BENCHMARKS.md, not in assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def test_manager_benchmark_runs(tmp_path: Path, mooncake_trace: Path) -> None:
    from tiering.replay import load_trace

    trace = tmp_path / "head.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"input_length": r.input_length, "hash_ids": list(r.hash_ids)}) + "\n"
            for r in load_trace(mooncake_trace).requests[:400]
        )
    )
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "manager.py"),
            "--trace",
            str(trace),
            "--capacity",
            "256",
            "--repeat",
            "1",
            "--no-vllm",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(out.stdout)
    assert [r["policy"] for r in report["results"]] == ["lru", "arc"]
    for row in report["results"]:
        assert row["manager"] == "kvtier" and row["block_refs"] > 0
        assert 0 < row["lookup_us"] < row["whole_us"]
