"""Registering the primary region with CUDA (`PrimaryRegion.pin`), on the fake CUDA layer's
libcuda: chunks, this worker's shard only, roll-back, and no error left pending."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.helpers.fake_cuda import FakeCuda  # noqa: E402
from tiers.region import PAGE, PrimaryRegion, RegionLayout  # noqa: E402

ONE = RegionLayout(num_slots=8, shard_bytes=PAGE)


@pytest.fixture
def fake() -> Iterator[FakeCuda]:
    made = FakeCuda()
    yield made
    made.close()


def test_pin_registers_whole_slots_in_chunks_and_unpins(tmp_path: Path, fake: FakeCuda) -> None:
    stride = ONE.slot_stride
    fake.register_cap = 3 * stride
    with PrimaryRegion.create("chunks", ONE, tmp_path) as region:
        assert region.pin(driver=fake.driver, chunk_bytes=3 * stride) and region.pinned
        base = region.address
        assert fake._ranges == {
            base: base + 3 * stride,
            base + 3 * stride: base + 6 * stride,
            base + 6 * stride: base + 8 * stride,
        }
        assert fake.is_pinned(region.shard_tensor(0))
        assert region.pin(driver=fake.driver)  # idempotent: nothing registered again
        assert len(fake._ranges) == 3
        region.unpin()
        assert not region.pinned and fake._ranges == {}
        region.unpin()


def test_a_worker_registers_only_its_shard_when_shards_are_whole_pages(
    tmp_path: Path, fake: FakeCuda
) -> None:
    layout = RegionLayout(num_slots=4, shard_bytes=2 * PAGE, num_workers=2)
    with PrimaryRegion.create("shards", layout, tmp_path) as region:
        assert region.pin(1, driver=fake.driver)
        for slot in range(4):
            at = region.address + slot * layout.slot_stride
            assert fake.registration(at, 2 * PAGE) == "none"  # rank 0's shard
            assert fake.registration(at + 2 * PAGE, 2 * PAGE) == "all"
        assert len(fake._ranges) == 4


def test_shards_that_share_pages_register_whole_slots(tmp_path: Path, fake: FakeCuda) -> None:
    layout = RegionLayout(num_slots=4, shard_bytes=3000, num_workers=2)
    with PrimaryRegion.create("shared-pages", layout, tmp_path) as region:
        assert region.pin(1, driver=fake.driver)
        assert fake._ranges == {region.address: region.address + 4 * layout.slot_stride}


@pytest.mark.parametrize(
    ("cap", "fail"),
    [(PAGE, {}), (1 << 40, {"cuMemHostRegister_v2": 2})],
    ids=["above-the-driver-ceiling", "second-chunk-fails"],
)
def test_a_failed_pin_is_logged_rolled_back_and_leaves_no_pending_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, cap: int, fail: dict[str, int]
) -> None:
    """Finding 2: through the driver API a failed registration leaves nothing for torch's
    next launch to raise (through torch's cudaHostRegister it would: see the last lines)."""
    fake = FakeCuda(register_cap=cap, fail=fail)  # type: ignore[arg-type]
    try:
        with PrimaryRegion.create("failed", ONE, tmp_path) as region:
            with caplog.at_level(logging.WARNING, "tiers.region"):
                assert region.pin(driver=fake.driver, chunk_bytes=4 * ONE.slot_stride) is False
            assert "copies stay pageable" in caplog.text and not region.pinned
            assert fake._ranges == {}  # the first chunk, if it went in, is unregistered
            fake.launch_check()  # nothing pending
            assert fake.runtime_host_register(region.address, 1 << 41) == 2
            with pytest.raises(RuntimeError, match="CUDA error: 2"):
                fake.launch_check()
    finally:
        fake.close()


def test_unpin_logs_a_failed_unregistration(
    tmp_path: Path, fake: FakeCuda, caplog: pytest.LogCaptureFixture
) -> None:
    with PrimaryRegion.create("unpin", ONE, tmp_path) as region:
        assert region.pin(driver=fake.driver)
        fake.unregister(region.address)  # gone behind the region's back
        with caplog.at_level(logging.WARNING, "tiers.region"):
            region.unpin()
        assert "cuMemHostUnregister failed (713)" in caplog.text and not region.pinned
