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

from tests.helpers.namespaces import in_another_pid_namespace
from tests.helpers.paths import ROOT
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


def mapped_bytes(path: Path) -> int:
    """Bytes of `path`'s mappings in this process that have pages behind them (smaps' Rss)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's first line
            inside = line.endswith(str(path))
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def test_prefault_maps_every_page_in_the_background_and_writes_nothing(tmp_path: Path) -> None:
    layout = RegionLayout(num_slots=64, shard_bytes=1 << 20)
    with PrimaryRegion.create("prefault", layout, tmp_path) as region:
        slots = region.slots()
        slots[3, :5] = 9  # a block already there
        assert mapped_bytes(region.path) < 2 * PAGE * 2
        assert region.prefault()
        assert region.prefault_done(10)
        assert mapped_bytes(region.path) >= 64 * layout.slot_stride
        assert list(slots[3, :6]) == [9, 9, 9, 9, 9, 0] and not slots[4].any()
        del slots


def test_a_workers_prefault_maps_only_its_shard(tmp_path: Path) -> None:
    layout = RegionLayout(num_slots=32, shard_bytes=16 * PAGE, num_workers=2)
    with PrimaryRegion.create("shards", layout, tmp_path) as region:
        assert region.prefault(rank=1) and region.prefault_done(10)
        mapped = mapped_bytes(region.path)
        assert 32 * 16 * PAGE <= mapped < 32 * 20 * PAGE  # its half of each slot, not the other


def test_closing_during_a_prefault_stops_it_before_unmapping(tmp_path: Path) -> None:
    layout = RegionLayout(num_slots=256, shard_bytes=1 << 20)  # 256 MiB: ~0.1-0.2 s to map
    region = PrimaryRegion.create("stopped", layout, tmp_path)
    assert region.prefault()
    region.close()  # joins the thread within a chunk; no access to the unmapped pages follows
    assert not region.path.exists()
    assert region.prefault_done(0)


@pytest.mark.gpu
def test_a_failed_pin_leaves_no_cuda_error_pending(tmp_path: Path) -> None:
    """A second registration of the same pages fails (712); through the driver API it leaves
    nothing pending for torch's next launch to raise."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available on this machine")
    with PrimaryRegion.create("pin-twice", LAYOUT, tmp_path) as region:
        assert region.pin()
        held, driver = region._pinned, region._driver
        region._pinned, region._driver = [], None
        assert region.pin() is False
        region._pinned, region._driver = held, driver
        torch.ones(4, device="cuda").add_(1)
        torch.cuda.synchronize()


def test_a_process_in_another_pid_namespace_leaves_a_live_region(tmp_path: Path) -> None:
    """A kvtier process starting in another pid namespace (a container sharing /dev/shm)
    creates its region beside a live engine's: the live one stays, mapped and whole. Before,
    its creator's pid did not exist over there, so it was removed as stale."""
    live = PrimaryRegion.create("live", LAYOUT, tmp_path)
    live.slots()[0, :4] = [1, 2, 3, 4]
    try:
        out = in_another_pid_namespace(
            "from tiers.region import PrimaryRegion, RegionLayout, cleanup_stale\n"
            "print(cleanup_stale(sys.argv[1]))\n"
            "PrimaryRegion.create('neighbour', RegionLayout(4, 4096), sys.argv[1]).close()\n",
            str(tmp_path),
        )
        assert out.strip() == "[]"
        assert region_path("live", tmp_path).exists()
        with PrimaryRegion.attach("live", LAYOUT, tmp_path) as again:
            assert again.token == live.token
            assert list(again.slots()[0, :4]) == [1, 2, 3, 4]
    finally:
        live.close()


def test_a_dead_region_is_removed_from_another_pid_namespace(tmp_path: Path) -> None:
    """The lock is the kernel's answer in every namespace: a region nobody holds any more (its
    creator closed its descriptor without removing it, as a kill does) is removed from there."""
    import fcntl

    region = PrimaryRegion.create("gone", LAYOUT, tmp_path)
    region.owner = False  # (its close leaves the file, as a killed creator's would)
    region.close()
    assert region_path("gone", tmp_path).exists()
    with open(region_path("gone", tmp_path), "rb") as f:  # nobody holds it
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    out = in_another_pid_namespace(
        "from tiers.region import cleanup_stale\nprint(len(cleanup_stale(sys.argv[1])))\n",
        str(tmp_path),
    )
    assert out.strip() == "1"
    assert not region_path("gone", tmp_path).exists()


def test_a_region_sized_but_not_yet_headed_is_being_created(tmp_path: Path) -> None:
    """The creator sizes the file (zeros) before it writes the header: a worker that reads it
    in between waits for the header instead of failing its start ("not a kvtier region", seen
    once with two workers starting beside the scheduler); a file of another format is still
    refused."""
    from tiers.region.file import read_header

    path = region_path("being-made", tmp_path)
    path.write_bytes(bytes(PAGE))
    assert read_header(path) is None
    path.write_bytes(b"NOTKVTIER" + bytes(PAGE))
    with pytest.raises(RegionError, match="not a kvtier region"):
        read_header(path)
