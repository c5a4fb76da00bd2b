"""bench/ttft.py: its smoke run (the 2-layer Llama, short prompts, one round) on a real vLLM
engine, and the order of its set-ups. Timings are not asserted (they are figures for
BENCHMARKS.md); what each return found, and from where, and its first token are.

The smoke run here takes vLLM alone, the primary, the segment layout's and S3's warm restarts
and the warm start (every engine costs 20-40 s on this machine): the bench's code for the
`files` layout differs from the segment layout's by its name alone, and Redis's by its tier
entry and its raw read; both run in the full command (and in `--smoke` without `--setups`)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.ttft import SETUPS, rotated
from kvtier.venv import ensure_vllm_venv
from tests.helpers.paths import ROOT

SOURCES = {
    "primary": "host_cached_tokens",
    "file/segments": "disk_cached_tokens",
    "file/warm-start": "host_cached_tokens",
    "s3": "remote_cached_tokens",
}
"""The set-ups the smoke run takes besides vLLM alone, and where each return's tokens come from."""


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    return ensure_vllm_venv()


def test_each_round_starts_one_set_up_later() -> None:
    names = list(SETUPS)
    orders = [rotated(names, r) for r in range(len(names) + 1)]
    assert orders[0] == names and orders[len(names)] == names
    assert [order[0] for order in orders[: len(names)]] == names  # each set-up goes first once
    assert all(sorted(order) == sorted(names) for order in orders)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.s3
def test_smoke_run_serves_every_return_from_its_set_up(tmp_path: Path, vllm_python: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "ttft.py"),
            *("--smoke", "--json", "--setups", ",".join(SOURCES), "--dir", str(tmp_path)),
            *("--vllm-python", str(vllm_python)),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads(out.stdout)
    assert report["problems"] == []
    workload = report["workload"]
    prompt, kv_bytes = workload["prompt_tokens"], workload["kv_bytes"]
    blocks = prompt // 32

    (round_,) = report["per_round"]
    assert round_["order"] == ["vllm", *SOURCES]
    got = round_["setups"]
    assert list(got) == ["vllm", *SOURCES]
    # vLLM alone recomputes the return; its engine hits find all but the last block.
    assert got["vllm"]["cached_tokens"] == 0
    assert round_["engine_hit"]["cached_tokens"] == [prompt - 32] * 3
    first_token = got["vllm"]["tokens"]
    assert round_["engine_hit"]["tokens"] == [first_token] * 3
    for name, source in SOURCES.items():
        metrics = got[name]["metrics"]
        assert got[name]["tokens"] == first_token, name  # the same output as recomputing
        assert got[name]["cached_tokens"] == prompt, name
        assert metrics[source] == prompt, name
        assert metrics["load_bytes"] == kv_bytes, name
        if name == "file/warm-start":  # read into the primary at start, before the return
            assert metrics["blocks_warmed"] == blocks, name
            assert metrics.get("disk_cached_tokens", 0) == 0, name
        elif name != "primary":  # a warm restart: an empty primary, every block promoted
            assert metrics.get("host_cached_tokens", 0) == 0, name
        if name != "primary":
            assert metrics["tier_promotions"] == blocks, name
            assert round_["fill"][name] == blocks, name  # the first engine stored them all

    rows = {row["setup"]: row for row in report["rows"]}
    assert list(rows) == ["engine hit", "vllm", *SOURCES]
    assert rows["vllm"]["vs_recompute"] == 1.0
    assert rows["primary"]["vs_primary"] == 1.0
    assert rows["vllm"]["first_vs_vllm"] == 1.0  # each engine process's first request, measured
    assert all({"first", "first_vs_vllm"} <= rows[name].keys() for name in SOURCES)
    for name in SOURCES:
        assert {"limit", "vs_limit", "vs_primary", "raw_gib_s"} <= rows[name].keys(), name
        if name != "primary":
            assert {"promotion_gib_s", "promotion_vs_raw"} <= rows[name].keys(), name
    for row in rows.values():
        timed = (v for k, v in row.items() if k.startswith(("ttft", "vs_", "first")))
        assert all(positive(v) for v in timed), row
        assert all(positive(row[k]) for k in ("limit", "raw_gib_s", "promotion_vs_raw") if k in row)
    assert list(tmp_path.iterdir()) == []  # its scratch directory is gone


def positive(value: Any) -> bool:
    return isinstance(value, float | int) and math.isfinite(value) and value > 0
