"""bench/write_once.py, small: three engines' tiers (processes of their own) put the same blocks
into one store at once; on the stores that write once, the store holds each block once and every
copy but the first is counted as a duplicate, while the S3 baseline without `write_once` writes
every copy."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT

pytestmark = [pytest.mark.redis, pytest.mark.s3, pytest.mark.slow]


def test_a_fleet_putting_the_same_blocks_at_once_writes_each_once() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "bench/write_once.py",
            "--engines",
            "3",
            "--blocks",
            "8",
            "--size",
            "64KiB",
            "--media",
            "redis,files,s3,s3-replacing",
            "--stagger",
            "0",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    for medium in ("redis @0s", "files @0s", "s3 @0s"):
        r = report[medium]
        assert r["puts"] == 24 and r["errors"] == 0, (medium, r)
        assert r["duplicates"] == 16 and r["objects_stored"] == 8, (medium, r)
        assert r["written_share"] == pytest.approx(1 / 3), (medium, r)
    baseline = report["s3-replacing @0s"]
    assert baseline["duplicates"] == 0 and baseline["written_share"] == 1.0
