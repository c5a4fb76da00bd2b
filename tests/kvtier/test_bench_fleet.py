"""bench/fleet.py: its smoke run (the 2-layer Llama, one conversation per engine, one round) of two
real vLLM engines at once on one Redis server, against each engine alone. Timings are not
asserted (they are figures for BENCHMARKS.md); that every turn in the fleet and alone gave the
same tokens, that the fleet's returning turns found their prefixes in the store while the
engines alone found none, and that every figure is there, are."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.fleet import figures, summarize
from tests.helpers.paths import ROOT


def out(turn: int, ttft: float, seconds: float, cached: int = 0) -> dict[str, Any]:
    return {
        "turn": turn,
        "ttft": ttft,
        "seconds": seconds,
        "prompt_tokens": 100,
        "tokens": [7] * 10,
        "cached_tokens": cached,
    }


def test_figures_split_first_and_returning_turns_and_ratios_are_fleet_over_alone() -> None:
    fleet = [out(0, 0.2, 0.5), out(1, 0.1, 0.4, cached=64), out(2, 0.3, 0.6, cached=96)]
    alone = [out(0, 0.1, 0.25), out(1, 0.4, 0.8), out(2, 0.4, 0.95)]
    got = figures(fleet)
    assert got["ttft_first"] == 0.2 and got["ttft_return"] == pytest.approx(0.2)
    assert got["tokens_per_s"] == pytest.approx(330 / 1.5)
    assert got["return_cached_share"] == pytest.approx(160 / 200)
    record = {
        "engines": [
            {"fleet": got, "alone": figures(alone), "fleet_metrics": {"tier_promotions": 5}}
        ],
        "fleet_tokens_per_s": 300.0,
        "alone_tokens_per_s": 150.0,
    }
    engine, whole = summarize([record])
    assert engine["ttft_first_ratio"] == pytest.approx(2.0)
    assert engine["ttft_return_ratio"] == pytest.approx(0.2 / 0.4)
    assert engine["tokens_per_s_ratio"] == pytest.approx((330 / 1.5) / (330 / 2.0))
    assert engine["alone_return_cached_share"] == 0 and engine["promotions"] == 5
    assert whole["engine"] == "fleet" and whole["tokens_per_s_ratio"] == 2.0


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.redis
def test_smoke_run_of_two_engines_on_redis(tmp_path: Path, vllm_python: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "fleet.py"),
            *("--smoke", "--json", "--engines", "2", "--medium", "redis", "--dir", str(tmp_path)),
            *("--vllm-python", str(vllm_python)),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout)
    assert report["problems"] == []
    (round_,) = report["per_round"]
    assert len(round_["engines"]) == 2
    for engine in round_["engines"]:
        # Three turns of one conversation per engine: each engine served two returning turns
        # (one of another's conversation), whose prefixes came back from Redis in the fleet.
        assert engine["fleet"]["requests"] == engine["alone"]["requests"] == 3
        assert engine["fleet"]["return_cached_share"] > 0.5
        assert engine["alone"]["return_cached_share"] < engine["fleet"]["return_cached_share"]
        assert engine["fleet_metrics"]["tier_promotions"] > 0
    rows = report["rows"]
    assert [r["engine"] for r in rows] == [0, 1, "fleet"]
    for row in rows:
        ratios = [v for k, v in row.items() if k.endswith("_ratio")]
        assert ratios and all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in ratios)
    assert list(tmp_path.iterdir()) == []  # its scratch directory is gone
