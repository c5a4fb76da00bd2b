"""The shared primary region: layout, sharing between processes, lifecycle and failures."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT
from tiering.errors import RegionError
from tiers.region import PAGE, PrimaryRegion, RegionLayout, cleanup_stale, region_path

LAYOUT = RegionLayout(num_slots=8, shard_bytes=3000, num_workers=2)


def test_layout_rounds_slots_to_pages() -> None:
    assert LAYOUT.slot_stride == -(-6000 // PAGE) * PAGE
    assert LAYOUT.file_size == PAGE + 8 * LAYOUT.slot_stride
    with pytest.raises(RegionError, match="num_slots must be a positive integer"):
        RegionLayout(0, 10)


def test_create_is_sparse_and_close_removes(tmp_path: Path) -> None:
    big = RegionLayout(num_slots=1024, shard_bytes=1 << 20)  # 1 GiB, never touched
    region = PrimaryRegion.create("sparse", big, tmp_path)
    stat = region.path.stat()
    assert stat.st_size == big.file_size
    assert stat.st_blocks * 512 < 1 << 20  # only the header page is backed
    region.close()
    assert not region.path.exists()
    region.close()  # twice is fine


def test_views_share_bytes(tmp_path: Path) -> None:
    with PrimaryRegion.create("views", LAYOUT, tmp_path) as region:
        slots = region.slots()
        assert slots.shape == (8, LAYOUT.slot_stride)
        shard1 = region.shard_tensor(1)
        assert tuple(shard1.shape) == (8, 3000) and shard1.stride() == (LAYOUT.slot_stride, 1)
        shard1[5, :4] = 7
        assert list(slots[5, 3000:3004]) == [7, 7, 7, 7]
        assert (
            bytes(
                region.memoryview()[5 * LAYOUT.slot_stride + 3000 : 5 * LAYOUT.slot_stride + 3002]
            )
            == b"\x07\x07"
        )
        with pytest.raises(RegionError, match="rank 2 is outside 0..1"):
            region.shard(2)
        del slots, shard1


def test_another_process_sees_and_writes_the_same_pages(tmp_path: Path) -> None:
    with PrimaryRegion.create("shared", LAYOUT, tmp_path) as region:
        region.slots()[2, :5] = np.frombuffer(b"hello", dtype=np.uint8)
        child = textwrap.dedent(
            f"""
            from tiers.region import PrimaryRegion, RegionLayout
            region = PrimaryRegion.attach("shared", RegionLayout(8, 3000, 2), {str(tmp_path)!r})
            assert bytes(region.slots()[2, :5]) == b"hello"
            shard = region.shard_tensor(1)
            shard[3, :3] = 42
            del shard
            region.close()
            """
        )
        subprocess.run([sys.executable, "-c", child], check=True, cwd=ROOT)
        assert list(region.shard(1)[3, :3]) == [42, 42, 42]
        assert region.path.exists()  # only the creator removes it


def test_attach_checks_layout_and_waits_for_creator(tmp_path: Path) -> None:
    with pytest.raises(RegionError, match="not created within 0.05s"):
        PrimaryRegion.attach("nobody", directory=tmp_path, timeout=0.05)
    with PrimaryRegion.create("lay", LAYOUT, tmp_path):
        with pytest.raises(RegionError, match="has layout .* expected"):
            PrimaryRegion.attach("lay", RegionLayout(8, 3000, 1), tmp_path)
        joined = PrimaryRegion.attach("lay", directory=tmp_path)
        assert joined.layout == LAYOUT and not joined.owner
        joined.close()


def test_too_large_names_sizes(tmp_path: Path) -> None:
    huge = RegionLayout(num_slots=1 << 30, shard_bytes=1 << 30)  # 1 EiB
    with pytest.raises(RegionError) as info:
        PrimaryRegion.create("huge", huge, tmp_path)
    message = str(info.value)
    assert f"needs 1048576.0 TiB ({huge.file_size} bytes)" in message
    assert f"{tmp_path} has" in message and "available" in message
    assert not region_path("huge", tmp_path).exists()


def test_live_collision_is_an_error(tmp_path: Path) -> None:
    with PrimaryRegion.create("twice", LAYOUT, tmp_path):
        with pytest.raises(RegionError, match=f"belongs to live process {os.getpid()}"):
            PrimaryRegion.create("twice", LAYOUT, tmp_path)


def test_stale_region_of_a_killed_process_is_removed(tmp_path: Path) -> None:
    child = textwrap.dedent(
        f"""
        import sys, time
        from tiers.region import PrimaryRegion, RegionLayout
        PrimaryRegion.create("crashed", RegionLayout(4, 4096), {str(tmp_path)!r})
        print("ready", flush=True)
        time.sleep(60)
        """
    )
    with subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, cwd=ROOT) as proc:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    path = region_path("crashed", tmp_path)
    assert path.exists()  # nobody cleaned up after the crash
    other = PrimaryRegion.create("other", LAYOUT, tmp_path)  # any start cleans the directory
    assert not path.exists()
    other.close()
    assert cleanup_stale(tmp_path) == []


def test_bad_names(tmp_path: Path) -> None:
    for name in ("../etc", "", "a/b", "x" * 129):
        with pytest.raises(RegionError, match="primary region name"):
            PrimaryRegion.create(name, LAYOUT, tmp_path)


def test_closed_region_refuses_views(tmp_path: Path) -> None:
    region = PrimaryRegion.create("closed", LAYOUT, tmp_path)
    region.close()
    with pytest.raises(RegionError, match="is closed"):
        region.slots()


def test_pin_without_cuda_is_a_no_op(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("covered by the gpu tests")
    with PrimaryRegion.create("pin", LAYOUT, tmp_path) as region:
        assert region.pin() is False and not region.pinned


@pytest.mark.gpu
def test_pin_registers_with_cuda(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available on this machine")
    with PrimaryRegion.create("pin-cuda", LAYOUT, tmp_path) as region:
        assert region.pin() and region.pinned
        assert region.pin()  # idempotent
        assert region.shard_tensor(0).is_pinned()
        region.unpin()
        assert not region.pinned


def test_open_creates_or_joins(tmp_path: Path) -> None:
    first = PrimaryRegion.open("engine-1", LAYOUT, tmp_path)
    second = PrimaryRegion.open("engine-1", LAYOUT, tmp_path)
    assert first.owner and not second.owner
    second.slots()[1, :2] = 5
    assert list(first.slots()[1, :2]) == [5, 5]
    with pytest.raises(RegionError, match="has layout"):
        PrimaryRegion.open("engine-1", RegionLayout(8, 100), tmp_path)
    second.close()
    assert first.path.exists()
    first.close()
    assert not first.path.exists()
