"""Where the tests find the checkout, the traces and the user's home (test process)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
"""The checkout."""
SHARED_TRACES = ROOT.parent / "shared" / "traces"
SHIPPED_TRACES = ROOT / "bench" / "traces"
REAL_HOME = Path.home()
"""The user's home, as the test session found it: no test writes there (`test_home` in
tests/conftest.py)."""
