"""What the manifest's tests share (`tests/tiering/test_manifest*.py`): a file tier over a test
directory, a warm-start primary, and a bounded wait on a harness's manager."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.helpers.manager import BLOCK, Harness
from tiering.config import PrimaryConfig, TierConfig
from tiering.testing import NAMESPACE
from tiering.tier import Tier
from tiers.file import BlockFileTier, SegmentFileTier

THROUGH = TierConfig(name="nvme", type="file", write="through")
"""A file tier the harness writes through."""


def file_tier(path: Path, layout: str = "files", **kw: Any) -> Tier:
    cls = BlockFileTier if layout == "files" else SegmentFileTier
    kw.setdefault("namespace", NAMESPACE)
    return cls(name="nvme", path=path, min_free=0, direct=False, **kw)


def warm(blocks: int, **kw: Any) -> PrimaryConfig:
    """A primary whose warm start reads up to `blocks` blocks (it writes manifests)."""
    return PrimaryConfig(warm_start=blocks * BLOCK, **kw)


def wait_for(h: Harness, done: Callable[[], bool], timeout: float = 10.0) -> None:
    """Until `done()` (asked under the manager's lock), at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with h.manager.quiet():
            if done():
                return
        time.sleep(0.005)
    raise AssertionError("timed out")
