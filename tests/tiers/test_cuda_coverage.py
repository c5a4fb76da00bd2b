"""The CUDA engine's code runs in CI (issue 41, item 6): on a machine without CUDA, the copy
engine tests over the fake CUDA layer execute at least 95 % of the lines of `tiers/copy/cuda.py`
and `tiers/copy/cuda_driver.py` (all but loading the real libcuda). `tiers/copy/cuda_api.py`'s
`TorchCuda` is torch on a real device and runs only in the `gpu` tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

pytest.importorskip("torch")
pytest.importorskip("coverage")


@pytest.mark.slow
def test_the_fake_runs_at_least_95_percent_of_the_cuda_engine(tmp_path: Path) -> None:
    env = {**os.environ, "COVERAGE_FILE": str(tmp_path / "coverage")}
    tests = ["tests/tiers/test_copy.py", "tests/tiers/test_copy_cuda.py", "-k", "not cpu"]
    subprocess.run(
        [sys.executable, "-m", "coverage", "run", "--source=tiers.copy", "-m", "pytest"]
        + ["-q", "-p", "no:cacheprovider", *tests],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        timeout=240,
    )
    for module in ("tiers/copy/cuda.py", "tiers/copy/cuda_driver.py"):
        report = subprocess.run(
            [sys.executable, "-m", "coverage", "report", "--include", module, "--format=total"],
            cwd=ROOT,
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
        assert int(report.stdout.strip()) >= 95, (module, report.stdout)
