"""kvtier/scenario.py's engine processes, with a stand-in for vLLM's python: a script that does
what the scenario's `stand_in` key says (write a result, fail, hang), so that what the caller
does with several engines at once (results in order, the first failure or the timeout stopping
the others at once) is tested in a second rather than in minutes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.scenario import run_scenario, run_scenarios

STAND_IN = """
import json, os, sys, time
scenario, result = json.loads(open(sys.argv[3]).read()), sys.argv[4]
action = scenario["stand_in"]
with open(scenario["pids"], "a") as f:
    f.write(f"{os.getpid()}\\n")
if scenario.get("progress"):
    with open(scenario["progress"], "a") as f:
        f.write("starting\\n")
print("engine log line", flush=True)
if action == "fail":
    time.sleep(0.2)
    sys.exit("engine failed: bad config")
if action == "hang":
    time.sleep(120)
with open(result, "w") as f:
    json.dump({"outputs": [scenario["answer"]], "metrics": {}, "seconds": 0.0}, f)
"""


@pytest.fixture
def python(tmp_path: Path) -> Path:
    """An executable that takes `python -m connectors.vllm.run SCENARIO RESULT` and runs the
    stand-in on them."""
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    path = tmp_path / "python"
    path.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    path.chmod(0o755)
    return path


def scenario(tmp_path: Path, action: str, answer: int = 0) -> dict[str, object]:
    return {"stand_in": action, "answer": answer, "pids": str(tmp_path / "pids")}


def alive(tmp_path: Path) -> list[int]:
    pids = [int(line) for line in (tmp_path / "pids").read_text().split()]
    running = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        running.append(pid)
    return running


def test_results_come_back_in_the_order_of_the_scenarios(python: Path, tmp_path: Path) -> None:
    results = run_scenarios(
        python, [scenario(tmp_path, "ok", answer=i) for i in range(3)], tmp_path, timeout=60
    )
    assert [r["outputs"] for r in results] == [[0], [1], [2]]
    assert all("engine log line" in r["log"] for r in results)


def test_the_first_engine_that_fails_stops_the_others_at_once(python: Path, tmp_path: Path) -> None:
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="engine failed: bad config"):
        run_scenarios(
            python,
            [scenario(tmp_path, "hang"), scenario(tmp_path, "fail"), scenario(tmp_path, "hang")],
            tmp_path,
            timeout=60,
        )
    assert time.monotonic() - began < 20
    assert alive(tmp_path) == []


def test_the_timeout_stops_every_engine(python: Path, tmp_path: Path) -> None:
    began = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_scenarios(python, [scenario(tmp_path, "hang")] * 2, tmp_path, timeout=1)
    assert time.monotonic() - began < 10
    assert alive(tmp_path) == []


def test_one_engine_reports_its_progress(python: Path, tmp_path: Path) -> None:
    seen: list[str] = []
    result = run_scenario(python, scenario(tmp_path, "ok", 7), tmp_path, 60, seen.append)
    assert result["outputs"] == [7] and seen == ["starting"]
