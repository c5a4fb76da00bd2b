"""A real vLLM 0.32 engine on the CPU records its traffic (`trace.record`), and `kvtier replay` of
the recording at the engine's primary size and policy finds the hits the engine reported for
kvtier.

The scenario of shared/vllm-cpu-e2e.md (tests/helpers/vllm_runs.py): `first` (a 320-token prefix
and 40 tokens), `unrelated` (480 tokens, which push the prefix out of the engine's 18 blocks but
for its first), `again` (the prefix and 40 other tokens).

What is compared: the prompt tokens kvtier served (`kvtier_cached_tokens`, vLLM's
`prompt_tokens_cached` of kvtier's sources) against the replay's `hit_tokens`. The engine's own
prefix-cache hits are not kvtier's: vLLM never looks them up, so the recording leaves those
blocks out (`engine_blocks`) and neither side counts them. The replay measures the second half
of the requests (`kvtier.replay`: the first warms the pool up); the engine's first request is
served by a fresh kvtier, whose hits are none, so the totals are the same figures.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.scenario import run_scenario
from tests.helpers.vllm_runs import BLOCK_BYTES, PREFIX, kvtier_extra, scenario

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CAPACITY = "8MiB"


def test_a_recorded_engine_replays_to_the_hits_it_reported(
    vllm_python: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.jsonl"
    extra = kvtier_extra(tmp_path, "lru")
    extra["kvtier"]["primary"]["capacity"] = CAPACITY
    extra["kvtier"]["trace"] = {"record": str(trace)}
    result = run_scenario(vllm_python, scenario(tmp_path, extra), tmp_path)
    served = result["metrics"]["kvtier_cached_tokens"]
    assert served == PREFIX - 32  # the engine kept the prefix's first block; kvtier gave nine

    recorded = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(recorded) == 3  # one line per request, written when vLLM ended it
    block_tokens = recorded[0]["block_tokens"]
    assert sum(line["found"].count("primary") for line in recorded) * block_tokens == served
    assert recorded[2].get("engine_blocks") == 1  # the engine's own hit, not listed

    slots = (8 << 20) // BLOCK_BYTES
    argv = ["replay", str(trace), "--capacity", str(slots), "--policy", "lru", "--json"]
    assert main(argv) == 0
    (row,) = json.loads(capsys.readouterr().out)["results"]
    assert row["hit_tokens"] == served
