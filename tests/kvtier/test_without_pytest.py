"""The application runs where pytest is not installed: `kvtier bench` and its baselines import
no test machinery (tiering.testing.data is pytest-free; the suites are not)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.paths import ROOT

# A child in which `import pytest` fails as it does where pytest is not installed.
_NO_PYTEST = "import sys; sys.modules['pytest'] = None; sys.modules['_pytest'] = None\n"


def _child(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _NO_PYTEST + code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_kvtier_bench_runs_without_pytest(tmp_path: Path) -> None:
    config = tmp_path / "tiers.yaml"
    config.write_text(
        "version: 1\ntiers:\n"
        f"  - {{name: nvme, type: file, path: {tmp_path / 'nvme'}, min_free: 0}}\n"
    )
    done = _child(
        "from kvtier.cli import main\n"
        f"raise SystemExit(main(['bench', '--config', {str(config)!r}, '--tier', 'nvme',"
        " '--sizes', '64KiB', '--count', '8', '--json']))\n",
        tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads(done.stdout)
    assert row["put_gib_s"] > 0


def test_the_suites_do_need_pytest(tmp_path: Path) -> None:
    """The check above can fail: the conformance suite itself is refused in such a child."""
    done = _child("import tiering.testing.tier\n", tmp_path)
    assert done.returncode != 0 and "pytest" in done.stderr
