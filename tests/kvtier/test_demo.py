"""`kvtier demo`: a real vLLM engine (CPU build) with kvtier on a multi-turn chat workload whose
model makes recomputing a conversation cost real time. Checked: where the prompt tokens came
from in each run, each turn's time to first token without kvtier, with it and after a warm
restart, identical outputs, the progress lines while the engines run, and the command's
behaviour on bad input (before any engine starts).
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.cli.demo import table
from kvtier.demo import MAX_TURNS, DemoResult, engine_blocks

ROOT = Path(__file__).resolve().parents[2]
BLOCK_BYTES = 32 * 8 * 2 * 8 * 64 * 4  # tokens x layers x (K, V) x KV heads x head size x fp32


@pytest.mark.vllm
@pytest.mark.slow
def test_demo_serves_returning_turns_from_kvtier_and_from_disk_sooner_than_recompute(
    vllm_python: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--json", "--conversations", "3", "--turns", "3"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    alone, ours, warm = report["vLLM alone"], report["kvtier"], report["warm restart"]
    assert list(report) == ["vLLM alone", "kvtier", "warm restart", "identical_outputs"]
    assert report["identical_outputs"] is True
    assert ours["requests"] == warm["requests"] == alone["requests"] == 9
    assert ours["kvtier_tokens"] > 0 and alone["kvtier_tokens"] == 0
    assert ours["recomputed_tokens"] == alone["recomputed_tokens"] - ours["kvtier_tokens"]
    assert ours["bytes_loaded"] == ours["kvtier_tokens"] // 32 * BLOCK_BYTES
    # The restarted engine starts empty; what its own cache lacks comes from disk.
    assert warm["tier_blocks"] > 0 and warm["recomputed_tokens"] == 0

    # Time to first token: by turn, then conversation, each within its run's time.
    for run in (alone, ours, warm):
        assert [len(turn) for turn in run["ttft"]] == [3, 3, 3]
        assert all(0 < t < run["seconds"] for turn in run["ttft"] for t in turn), run["ttft"]

    def mean(run: dict[str, list[list[float]]], turns: slice) -> float:
        return statistics.fmean(t for turn in run["ttft"][turns] for t in turn)

    # Returning turns recompute hundreds of tokens without kvtier and one block with it.
    assert mean(ours, slice(1, None)) < mean(alone, slice(1, None)), (ours["ttft"], alone["ttft"])
    assert mean(warm, slice(None)) < mean(alone, slice(None)), (warm["ttft"], alone["ttft"])

    # Progress: standard error is no terminal here, so one plain line per step of each engine.
    steps = re.findall(
        r"^kvtier demo: engine (\d)/3 \((.+?)\): (.+) \(\d+ (?:s|min \d\d s)\)$",
        captured.err,
        re.MULTILINE,
    )
    requests = [f"request {i}/9" for i in range(1, 10)]
    assert steps == [
        (str(n), name, step)
        for n, name in enumerate(["vLLM alone", "kvtier", "warm restart"], 1)
        for step in ["starting", "warming up", *requests, "done"]
    ], captured.err
    assert "\r" not in captured.err


def result(ttft: list[list[float]], kvtier_tokens: int) -> DemoResult:
    return DemoResult(
        requests=4,
        prompt_tokens=2048,
        engine_cached_tokens=512,
        kvtier_tokens=kvtier_tokens,
        recomputed_tokens=1536 - kvtier_tokens,
        bytes_loaded=kvtier_tokens * 32768,
        bytes_stored=0,
        tier_blocks=0,
        copy_seconds=0.0125,
        seconds=3.25,
        ttft=ttft,
        outputs=[[1, 2], [3, 4], [5, 6], [7, 8]],
    )


def test_the_table_shows_each_turns_mean_time_to_first_token_per_run() -> None:
    lines = table(
        {
            "vLLM alone": result([[0.5, 0.7], [1.25, 1.75]], 0),
            "kvtier": result([[0.5, 0.5], [0.125, 0.125]], 1024),
        }
    )
    assert lines[0].split() == ["vLLM", "alone", "kvtier"]
    assert lines[1].strip() == "time to first token (mean)"
    assert lines[2].split() == ["turn", "1", "0.60", "s", "0.50", "s"]
    assert lines[3].split() == ["turn", "2", "1.50", "s", "0.12", "s"]
    assert "from kvtier" in lines[7] and lines[7].split()[-2:] == ["0", "1,024"]
    assert lines[-1] == "identical outputs: yes"


def test_the_engine_holds_the_longest_turn_and_little_more() -> None:
    # 256 system + 512 first message + 3 x (4 answer + 60 message), and the last answer:
    # 964 tokens, 31 blocks; vLLM keeps one spare.
    assert engine_blocks(4) == 33
    assert (engine_blocks(MAX_TURNS) - 1) * 32 <= 4096  # the model's positions


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--turns", str(MAX_TURNS + 1)],
            f"argument --turns: expected an integer from 1 to {MAX_TURNS}",
        ),
        (["--conversations", "0"], "argument --conversations: expected an integer from 1 to 100"),
        (["--compare", "--no-compare", "--config", ""], "argument --config: expected a path"),
        (["--config", "/nowhere/demo.yaml"], "/nowhere/demo.yaml: cannot read config"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_any_engine_starts(
    argv: list[str], message: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvtier", "demo", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    last = done.stderr.splitlines()[-1]
    assert last.startswith("kvtier demo: error: ") and message in last, done.stderr
    assert "Traceback" not in done.stderr and "engine" not in done.stderr
