"""The benchmarks run (their figures live in BENCHMARKS.md, not in assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers.paths import ROOT


def test_manager_benchmark_runs(tmp_path: Path, mooncake_trace: Path) -> None:
    from kvtier.trace import load_trace

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


def test_tiering_benchmark_runs_rounds(tmp_path: Path, mooncake_trace: Path) -> None:
    """bench/tiering.py: every setup runs in each round, ratios are per round, the tiers hit."""
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "tiering.py"),
            "--trace",
            str(mooncake_trace),
            "--requests",
            "150",
            "--capacity",
            "256",
            "--repeat",
            "2",
            "--dir",
            str(tmp_path),
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(out.stdout)
    rows = {row["setup"]: row for row in report["rows"]}
    assert list(rows) == ["primary only", "primary + file", "primary + memory + file"]
    assert rows["primary only"]["cost_ratios"] == [1.0, 1.0]
    for name in ("primary + file", "primary + memory + file"):
        row = rows[name]
        assert len(row["cost_ratios"]) == 2 and row["cost_ratio"] > 0
        assert row["hit_rate"] > rows["primary only"]["hit_rate"]  # the file tier serves hits
        assert row["tier_hit_rates"]["nvme"] > 0
    assert list(tmp_path.iterdir()) == []  # the scratch directory is gone


def test_tier_benchmark_compares_kernel_aio_with_the_thread_pool(tmp_path: Path) -> None:
    """bench/tiers.py --aio both: a row for each way in every size and mode, each a ratio to a
    baseline run on the same directory; the scratch directory is removed."""
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "tiers.py"),
            *("--tiers", "file", "--layouts", "segments", "--aio", "both"),
            *("--repeat", "1", "--megabytes", "8", "--dir", str(tmp_path), "--json"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = json.loads(out.stdout)
    seen = {(row["tier"], row["block_bytes"], row["baseline"].split("tier: ")[1]) for row in rows}
    assert len(rows) == len(seen) == 12
    assert {tier for tier, _, _ in seen} == {"file/segments", "file/segments/threads"}
    assert all(row["put_ratio"] > 0 and row["get_ratio"] > 0 for row in rows)
    assert list(tmp_path.iterdir()) == []


def test_authenticated_objects_benchmark_runs(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "auth.py"),
            "--tiers",
            "memory,segments",
            "--sizes",
            "64KiB",
            "--megabytes",
            "2",
            "--repeat",
            "1",
            "--dir",
            str(tmp_path),
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = json.loads(out.stdout)
    assert [row["tier"] for row in rows] == ["memory", "file (segments)"]
    for mode in ("gmac", "encrypt"):
        assert all(row[f"{mode}_put_ratio"] > 0 and row[f"{mode}_get_ratio"] > 0 for row in rows)
    assert list(tmp_path.iterdir()) == []  # its scratch directory is gone
