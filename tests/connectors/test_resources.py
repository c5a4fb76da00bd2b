"""`connectors.resources.Resources`: one owner opens and closes what a role holds (the region
and the roster, the runtime and the tiers, the copy engine), once, whatever one step raises."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from connectors.resources import Resources
from tiering.config import Config, parse_config
from tiers.copy import CpuCopyEngine, GroupRef, KVTensor
from tiers.region import RegionLayout

LAYOUT = RegionLayout(num_slots=4, shard_bytes=256, num_workers=1)


def config(tmp_path: Path) -> Config:
    return parse_config(
        {"primary": {"directory": str(tmp_path)}, "tiers": [{"name": "m", "type": "memory"}]}
    )


def engine_id() -> str:
    return f"test-resources-{uuid.uuid4().hex}"


def copy_engine(resources: Resources) -> CpuCopyEngine:
    assert resources.region is not None
    cache = torch.zeros((8, 256), dtype=torch.int8)
    return CpuCopyEngine(
        [KVTensor(cache, 256)], [[GroupRef(0, 256)]], resources.region.shard_tensor(0)
    )


def test_closing_a_worker_stops_the_copy_engine_threads_and_unmaps_the_region(
    tmp_path: Path,
) -> None:
    resources = Resources()
    resources.open_region(engine_id(), LAYOUT, config(tmp_path), "worker rank 0")
    engine = resources.engine = copy_engine(resources)
    threads = [engine._lane.thread, engine._expedited.thread]
    assert all(thread.is_alive() for thread in threads)
    roster = resources.roster
    assert roster is not None and roster.path.exists()
    resources.close()
    assert not any(thread.is_alive() for thread in threads)
    assert resources.region is not None and resources.region._mmap is None
    assert not roster.path.exists()  # its last role left
    resources.close()  # once: a second close does nothing


def test_tiers_opened_without_a_manager_are_closed_with_the_runtime(tmp_path: Path) -> None:
    resources = Resources()
    runtime, ((_, tier),) = resources.open_tiers(config(tmp_path), bytes(16))
    runtime.run_sync(tier.stat, 5.0)  # the runtime's thread runs
    thread = runtime._thread
    assert thread is not None and thread.is_alive()
    resources.close()
    assert tier._closed and not thread.is_alive()


def test_a_failing_step_does_not_keep_the_rest_open(tmp_path: Path) -> None:
    resources = Resources()
    resources.open_region(engine_id(), LAYOUT, config(tmp_path), "scheduler")
    engine = resources.engine = copy_engine(resources)

    def broken() -> None:
        raise OSError("the engine failed to stop")

    shutdown = engine.shutdown
    engine.shutdown = broken  # type: ignore[method-assign]
    with pytest.raises(OSError, match="failed to stop"):
        resources.close()
    assert resources.region is not None and resources.region._mmap is None
    shutdown()
