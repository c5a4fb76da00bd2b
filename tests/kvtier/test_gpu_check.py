"""`scripts/gpu_check.sh`, checked on a CPU against the fake CUDA layer (issue 41, item 7):
every stage runs under a timeout, its figures land beside their targets in one summary JSON,
every timed copy is verified, and a stage that fails or gives nothing still leaves a summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

pytest.importorskip("torch")


def run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args,
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.slow
def test_the_check_runs_every_stage_on_the_fake_and_writes_each_target_beside_its_figure(
    tmp_path: Path,
) -> None:
    done = run(["bash", "scripts/gpu_check.sh", str(tmp_path)], KVTIER_GPU_CHECK_FAKE="1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] and summary["all_copies_verified"]
    assert summary["stages"] == {
        "facts": 0,
        "tests": 0,
        "gpu_copy": 0,
        "expedited": 0,
        "vllm_worker": 0,
    }
    worker = summary["worker_path"]  # vLLM 0.34's path: device pointers, bytes checked
    assert worker["verified"] is True and worker["stray_pointer_failed"] is True
    assert worker["pinned"] is True and worker["store_gbps"] > 0
    facts = summary["facts"]
    assert facts["batch_symbol"] == "cuMemcpyBatchAsync_v2" and facts["dev_shm_bytes"]
    names = [t["name"] for t in summary["targets"]]
    assert names == [
        "store, 2 MiB blocks",
        "load, 2 MiB blocks",
        "batched_submit_us, 4 KiB pieces",
        "speedup, 4 KiB pieces",
        "expedited load behind a backlog",
    ]
    for target in summary["targets"]:
        assert isinstance(target["figure"], float) and target["target"][:2] in (">=", "<=")
        assert target["met"] in (True, False) and target["verified"] is True
    assert summary["targets"][0]["pinned"] is True and summary["fallbacks"] == []


def test_a_stage_that_gave_nothing_is_in_the_summary_with_its_status(tmp_path: Path) -> None:
    (tmp_path / "stages.txt").write_text("facts 0\ntests 0\ngpu_copy 124\nexpedited 0\n")
    record = {"kind": "expedited", "expedited_ratio": 1.2, "verified": False, "pinned": False}
    (tmp_path / "expedited.jsonl").write_text(json.dumps(record) + "\n")
    done = run([sys.executable, "bench/gpu_check.py", "summary", str(tmp_path)])
    assert done.returncode == 1, done.stdout + done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert not summary["ok"] and not summary["all_copies_verified"]
    by_name = {t["name"]: t for t in summary["targets"]}
    assert by_name["store, ? blocks"]["figure"] is None
    assert by_name["store, ? blocks"]["missing"] == "stage gpu_copy exit status 124"
    assert by_name["expedited load behind a backlog"]["met"] is True
    assert summary["fallbacks"] == ["expedited: region not pinned (pageable copies)"]
    assert summary["worker_path"] == {"missing": "stage vllm_worker did not run"}


def test_the_stages_time_bounds_fit_five_minutes() -> None:
    """The device machines are lent for minutes: the stages' timeouts add up to at most five."""
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    bounds = [int(line.split()[2]) for line in script.splitlines() if line.startswith("stage ")]
    assert len(bounds) == 5 and sum(bounds) <= 300, bounds
