"""Read-only means read-only: the operator commands that only read (`stats`, `ls`, `inspect`,
`verify` without `--repair`, the source of a `migrate` that copies) create, rename and delete
nothing in a file tier's directory, report every damaged object instead of removing it, and
never disturb an engine writing there meanwhile."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.cli import main
from tests.helpers.paths import ROOT
from tiering.testing import NAMESPACE, key, payload
from tiers.file import BlockFileTier, FileTier

SIZE = 8192


def snapshot(root: Path) -> dict[str, tuple[int, int, int]] | None:
    """Every entry under `root`: (inode, size, mtime) by relative path; None when absent."""
    if not root.exists():
        return None
    found = {}
    for path in [root, *root.rglob("*")]:
        st = path.lstat()
        found[str(path.relative_to(root))] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return found


def config(tmp_path: Path, path: Path, layout: str) -> Path:
    file = tmp_path / "tiers.yaml"
    file.write_text(
        f"""
version: 1
tiers:
  - {{name: nvme, type: file, path: "{path}", min_free: 0, layout: {layout}}}
  - {{name: mem, type: memory}}
"""
    )
    return file


def populate(path: Path, layout: str) -> list[str]:
    """Good blocks, and damaged objects of each kind a scan meets; their descriptions."""

    async def body() -> None:
        async with FileTier.variant({"layout": layout})(
            namespace=NAMESPACE, path=path, min_free=0
        ) as tier:
            await tier.put_many([(key(i), payload(SIZE, i)) for i in range(6)])

    asyncio.run(body())
    root = path / NAMESPACE.hex()
    if layout == "files":
        tier_path = next(root.rglob(key(1).hex() + ".kv"))
        tier_path.write_bytes(b"garbage" * 200)  # header damage
        torn = next(root.rglob(key(2).hex() + ".kv"))
        torn.write_bytes(torn.read_bytes()[:5000])  # shorter than its header says
        long = next(root.rglob(key(3).hex() + ".kv"))
        long.write_bytes(long.read_bytes() + bytes(8192))  # longer than its header says
        live = tier_path.parent / f".{tier_path.name}.{os.getpid()}.7.tmp"
        live.write_bytes(b"a write in flight")  # its writer (this process) is alive
        return ["magic", "truncated", "length"]
    (segment,) = root.glob("*.kvs")
    data = bytearray(segment.read_bytes())
    data[12288 + 40] ^= 0xFF  # the header of the second block (records of 12 KiB)
    segment.write_bytes(bytes(data))
    return ["header"]


@pytest.mark.parametrize("layout", ["files", "segments"])
def test_read_only_commands_change_nothing_and_report_every_damaged_object(
    tmp_path: Path, layout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "nvme"
    damage = populate(path, layout)
    cfg = str(config(tmp_path, path, layout))
    before = snapshot(path)
    some_key = key(4).hex()
    commands: list[list[str]] = [
        ["stats"],
        ["stats", "--tier", "nvme"],
        ["ls", "--tier", "nvme"],
        ["inspect", "--tier", "nvme", some_key],
        ["verify", "--tier", "nvme"],
        ["migrate", "--from", "nvme", "--to", "mem", "--journal", str(tmp_path / "j")],
    ]
    codes = {}
    for argv in commands:
        codes[argv[0]] = main([argv[0], "--config", cfg, "--json", *argv[1:]])
        assert snapshot(path) == before, argv
    out = capsys.readouterr().out
    assert codes["verify"] == 1  # bad objects found, none removed
    for reason in damage:
        assert f'"{reason}"' in out, reason
    assert codes["stats"] == codes["ls"] == codes["inspect"] == 0


def test_verify_reports_what_it_found_damaged_and_repair_removes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    path = tmp_path / "nvme"
    damage = populate(path, "files")
    cfg = str(config(tmp_path, path, "files"))
    assert main(["verify", "--config", cfg, "--tier", "nvme", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert sorted(reason for _, reason in report["bad"]) == sorted(damage)
    assert report["checked"] == 6 and report["ok"] == 3 and report["repaired"] == 0
    assert main(["verify", "--config", cfg, "--tier", "nvme", "--repair", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["repaired"] == len(damage)
    assert main(["verify", "--config", cfg, "--tier", "nvme", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bad"] == []
    # the live writer's temporary file is still there: only a gone writer's is removed
    assert len(list(path.rglob("*.tmp"))) == 1


def test_stats_on_a_missing_directory_creates_nothing(tmp_path: Path) -> None:
    path = tmp_path / "not-yet"
    cfg = str(config(tmp_path, path, "files"))
    assert main(["stats", "--config", cfg]) == 0
    assert main(["verify", "--config", cfg, "--tier", "nvme", "--namespace", "00" * 16]) == 0
    assert not path.exists()


_WRITER = """
import asyncio, sys
from tiering.testing import NAMESPACE, key, payload
from tiers.file import BlockFileTier, FileTier

async def main() -> None:
    failed = 0
    async with BlockFileTier(namespace=NAMESPACE, path=sys.argv[1], min_free=0) as tier:
        for i in range(int(sys.argv[2])):
            try:
                await tier.put(key(i), payload(1 << 20, i % 4))
            except Exception as e:
                failed += 1
                print("FAILED", e, flush=True)
    print("failed", failed, flush=True)

asyncio.run(main())
"""


def test_a_live_writer_loses_no_put_beside_a_stats_loop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvtier stats` in a loop beside an engine's file tier (layout `files`: any number of
    processes may use the directory) removed the writer's temporary files mid-write."""
    path = tmp_path / "nvme"
    path.mkdir()
    cfg = str(config(tmp_path, path, "files"))
    n = 200
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path), str(n)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    loops = 0
    try:
        while writer.poll() is None:
            assert main(["stats", "--config", cfg, "--json"]) == 0
            loops += 1
        out, _ = writer.communicate(timeout=60)
    finally:
        if writer.poll() is None:
            writer.kill()
    assert loops > 10
    assert out.strip().splitlines()[-1] == "failed 0", out

    async def count() -> int:
        async with BlockFileTier(
            namespace=NAMESPACE, path=path, min_free=0, read_only=True
        ) as tier:
            return (await tier.stat()).objects

    assert asyncio.run(count()) == n


def test_operators_on_a_64_gib_sparse_file_report_it_and_go_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file claiming a 32 KiB block that is 64 GiB long (sparse): ls, inspect and verify
    report it without reading it (they aborted with "Cannot allocate memory"), and go on to
    the other blocks."""
    import json
    import tracemalloc

    path = tmp_path / "nvme"
    populate(path, "files")

    async def plant() -> Path:
        async with BlockFileTier(namespace=NAMESPACE, path=path, min_free=0) as tier:
            await tier.put(key(9), payload(32 << 10, 9))
            return tier._path(key(9))

    huge = asyncio.run(plant())
    with open(huge, "r+b") as f:
        f.truncate(64 << 30)
    cfg = str(config(tmp_path, path, "files"))
    tracemalloc.start()
    try:
        codes = [
            main(["ls", "--config", cfg, "--tier", "nvme", "--json"]),
            main(["inspect", "--config", cfg, "--tier", "nvme", "--json", key(9).hex()]),
            main(["verify", "--config", cfg, "--tier", "nvme", "--json"]),
        ]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak
    out = capsys.readouterr().out
    decoder = json.JSONDecoder()
    listing, at = decoder.raw_decode(out)
    inspected, at2 = decoder.raw_decode(out[at:].lstrip())
    report = json.loads(out[at:].lstrip()[at2:])
    assert codes == [0, 0, 1]
    assert {row["key"] for row in listing} >= {key(i).hex() for i in (0, 4, 5)}
    assert inspected["object_bytes"] == 64 << 30 and "length" in inspected["problem"]
    assert report["ok"] == 3 and (key(9).hex() in str(report["bad"]))


def test_verify_reports_an_object_it_cannot_read_and_goes_on() -> None:
    """One object's read failing (a deadline on a large object, an odd reply) is reported
    against that object; the rest are still checked (verify stopped at the first)."""
    from kvtier.operations import verify
    from tiering.tier.wrappers import FaultyTier
    from tiers.memory import MemoryTier

    async def body() -> None:
        inner = MemoryTier(namespace=NAMESPACE)
        for i in range(3):
            await inner.put(key(i), payload(SIZE, i))
        slow = FaultyTier(inner, delay=1.0, delay_seconds=0.2, timeout=0.05, seed=1)
        report = await verify(slow)
        assert report.checked == 3 and report.ok == 0
        assert [reason.split(":")[0] for _, reason in report.bad] == ["error"] * 3

    asyncio.run(body())
