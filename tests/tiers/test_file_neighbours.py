"""The file tier beside other processes writing the same directory: a writer in another pid
namespace (a container) loses no put while tiers start beside it."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiering.testing import NAMESPACE, key, payload
from tiers.file import BlockFileTier

ROOT = Path(__file__).resolve().parents[2]

# Runs as pid `target` of a new pid namespace: forks short-lived children until the next pid
# is `target`, then writes blocks (each one's temporary file named with that pid) until told
# to stop, and prints how many puts failed.
_WRITER = """
import asyncio, os, sys, time
from tiers.file import BlockFileTier
from tiering.testing import NAMESPACE, key, payload

path, target, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
while True:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    if pid >= target - 1:
        break
child = os.fork()
if child == 0:
    assert os.getpid() == target, os.getpid()

    async def main():
        failed = done = 0
        async with BlockFileTier(namespace=NAMESPACE, path=path, min_free=0, fsync=True) as tier:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                try:
                    await tier.put(key(done), payload(256 << 10, done))
                except Exception as e:
                    failed += 1
                    print("put failed:", e, file=sys.stderr)
                done += 1
        print(done, failed)

    asyncio.run(main())
    os._exit(0)
os.waitpid(child, 0)
"""


def _free_pid() -> int:
    """A pid no process of this (the outer) namespace has, low enough to reach by forking."""
    for pid in range(400, 4000):
        if not os.path.exists(f"/proc/{pid}"):
            return pid
    raise AssertionError("no free pid below 4000")


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs root")
def test_a_writer_in_another_pid_namespace_loses_no_put_beside_starting_tiers(
    tmp_path: Path,
) -> None:
    """A temporary file whose writer's pid means nothing here (another pid namespace: a
    container on the same host directory) is a write in flight: tiers starting beside it
    (each scanning the directory) leave it alone, and every one of its puts lands."""
    target = _free_pid()
    writer = subprocess.Popen(
        [
            "unshare",
            "--pid",
            "--fork",
            sys.executable,
            "-c",
            _WRITER,
            str(tmp_path),
            str(target),
            "4",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    starts = 0
    try:
        deadline = time.monotonic() + 30
        while writer.poll() is None and time.monotonic() < deadline:
            if any(tmp_path.rglob("*.tmp")):  # start while a write is in flight
                asyncio.run(BlockFileTier(namespace=NAMESPACE, path=tmp_path, min_free=0).close())
                starts += 1
        out, err = writer.communicate(timeout=30)
    finally:
        writer.kill()
    assert writer.returncode == 0, err
    done, failed = map(int, out.split())
    assert starts >= 3 and done > 10, (starts, done)
    assert failed == 0, err


def test_a_temporary_name_another_writer_holds_is_left_to_it(tmp_path: Path) -> None:
    """A writer in another container may have this process's pid and count: the temporary
    name it holds is never this writer's (names carry a random tag), and a write never
    removes a temporary file it did not create."""

    async def body() -> None:
        async with BlockFileTier(namespace=NAMESPACE, path=tmp_path, min_free=0) as t:
            path = t._path(key(1))
            path.parent.mkdir(parents=True, exist_ok=True)
            theirs = path.with_name(f".{path.name}.{os.getpid()}.0.tmp")
            theirs.write_bytes(b"another container's write in flight")
            await t.put(key(1), payload(4096, 1))
            assert await t.get_bytes(key(1), 4096) == payload(4096, 1)
            assert theirs.read_bytes() == b"another container's write in flight"

    asyncio.run(body())
