"""bench/file_shared.py, small: a bounded files tier and an unbounded one both put and get every
block, and the report holds a rate and a ratio for each; a missing --dir is a one-line error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers.paths import ROOT


def test_the_bench_reports_both_cases(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "bench/file_shared.py",
            "--dir",
            str(tmp_path),
            "--mib",
            "2",
            "--size",
            "64KiB",
            "--repeat",
            "2",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert set(report) == {"unbounded", "bounded"}
    assert report["unbounded"]["put_ratio"] == 1.0
    for case in report.values():
        assert case["put_gib_s"] > 0 and case["get_gib_s"] > 0
        assert case["get_ratio"] > 0
    assert not list(tmp_path.iterdir())


def test_a_missing_directory_is_refused(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "bench/file_shared.py", "--dir", str(tmp_path / "absent")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--dir" in proc.stderr and "Traceback" not in proc.stderr
