"""kvtier's vLLM metrics of the tiers' usage and of blocks another engine stored: defined with
their help (`metric_definitions`) and filled by `KvtierManager.get_stats` once the usage poll
has answered, in vLLM's own stats object (vLLM 0.32's environment, in a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

pytestmark = [pytest.mark.vllm]

_PROBE = r"""
import json, sys, time
from pathlib import Path
import numpy as np
from connectors.vllm.manager import KvtierManager, metric_definitions
from tiering.config import Config, MetricsConfig, TierConfig
from tiering.manager import TieringOffloadingManager
from tiering.manager import close_tiers
from tiering.primary import PrimaryPool
from tiering.runtime import Runtime
from tiering.testing import NAMESPACE
from tiers.file import BlockFileTier

tier = BlockFileTier(namespace=NAMESPACE, path=Path(sys.argv[1]), min_free=0, name="nvme",
                     capacity=1 << 30)
config = Config(tiers=(TierConfig(name="nvme", type="file", capacity=1 << 30),),
                metrics=MetricsConfig(usage_interval=0.1))
memory = np.zeros((4, 4096), dtype=np.uint8)
manager = TieringOffloadingManager(
    PrimaryPool(4, "lru"), [(config.tiers[0], tier)], lambda s: memoryview(memory[s]),
    config=config, runtime=(runtime := Runtime()), block_tokens=32)
deadline = time.monotonic() + 20
while manager.usage.polls < 1 and time.monotonic() < deadline:
    time.sleep(0.02)
stats = KvtierManager(manager, None).get_stats()
manager.shutdown()
close_tiers(runtime, [(config.tiers[0], tier)])
runtime.shutdown()
print(json.dumps({
    "definitions": {name: [type(m).__name__, m.documentation, list(m.labelnames)]
                    for name, m in metric_definitions().items()},
    "reduced": stats.reduce(),
}))
"""


def test_usage_and_other_writer_metrics_are_defined_and_reported(
    vllm_python: Path,
    tmp_path: Path,
) -> None:
    (tmp_path / "nvme" / ("ab" * 16) / "ab" / "cd").mkdir(parents=True)
    (tmp_path / "nvme" / ("ab" * 16) / "ab" / "cd" / (("ab" * 36) + ".kv")).write_bytes(b"x" * 10)
    out = subprocess.run(
        [str(vllm_python), "-c", _PROBE, str(tmp_path / "nvme")],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    found = json.loads(out.strip().splitlines()[-1])
    definitions = found["definitions"]
    for name, kind in (
        ("vllm:kvtier_tier_usage_objects", "OffloadingGaugeMetadata"),
        ("vllm:kvtier_tier_usage_bytes", "OffloadingGaugeMetadata"),
        ("vllm:kvtier_tier_usage_namespaces", "OffloadingGaugeMetadata"),
        ("vllm:kvtier_tier_capacity_bytes", "OffloadingGaugeMetadata"),
        ("vllm:kvtier_tier_hits_other_writer", "OffloadingCounterMetadata"),
        ("vllm:kvtier_tier_usage_failures", "OffloadingCounterMetadata"),
    ):
        assert definitions[name][0] == kind and definitions[name][2] == ["tier"], name
        assert len(definitions[name][1]) > 20, name  # a help text, not a placeholder
    reduced = found["reduced"]
    assert reduced["vllm:kvtier_tier_usage_objects:('nvme',)"] == 1  # another namespace's
    assert reduced["vllm:kvtier_tier_usage_bytes:('nvme',)"] == 10
    assert reduced["vllm:kvtier_tier_capacity_bytes:('nvme',)"] == 1 << 30
    assert reduced["vllm:kvtier_tier_hits_other_writer:('nvme',)"] == 0
    assert reduced["vllm:kvtier_tier_usage_failures:('nvme',)"] == 0
