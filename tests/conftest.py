from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings

ROOT = Path(__file__).resolve().parent.parent
SHARED_TRACES = ROOT.parent / "shared" / "traces"
SHIPPED_TRACES = ROOT / "bench" / "traces"


@pytest.fixture(scope="session")
def mooncake_trace() -> Path:
    """The Mooncake conversation trace: the shared copy when there is one, else the shipped one.
    Both are the same requests (test_replay checks the shipped copy against the shared one)."""
    shared = SHARED_TRACES / "mooncake_conversation_trace.jsonl"
    return shared if shared.exists() else SHIPPED_TRACES / "mooncake_conversation_trace.jsonl.gz"


# No example database in the checkout: CI runs from a fresh clone, and a failure is reproduced
# from the seed Hypothesis prints.
settings.register_profile("kvtier", database=None, print_blob=True)
settings.load_profile("kvtier")
