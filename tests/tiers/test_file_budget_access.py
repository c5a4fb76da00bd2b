"""A `files` directory's byte count (`.kvtier/budget-v1`) that the starting process may not write
fails a writable tier's start with one line, within a second: it never starts silently and then
makes every put wait 2 s and fail `TierFull`.

The tests run as root here, and root writes through permission bits; so each failure is made
in a way the kernel refuses root too, by the same system call as for the real case:

- the ledger, or the `.kvtier` directory, immutable (`chattr +i`: EPERM on open for writing or
  on creating a file in it, as for a read-only file of another user: EACCES);
- the tier's directory on a read-only mount (a read-only bind mount in a private mount
  namespace, `unshare -m`, in a child process: EROFS);
- a ledger truly owned by another user: the tier started in a child process running as
  `nobody` (root owns the ledger, `.kvtier` is writable by all, as on a shared disk).

Without root (a developer's machine, CI in a container) permission bits do it (`chmod a-w`),
and the tests needing root are skipped.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.cli import main
from tests.helpers.paths import ROOT
from tiering.errors import ConfigError
from tiering.keys import make_key
from tiering.testing import payload
from tiers.file import BlockFileTier

NS = bytes(range(90, 106))
CAPACITY = 64 << 20
ROOT_USER = os.geteuid() == 0
NOBODY = 65534


def tier(path: Path, **extra: object) -> BlockFileTier:
    return BlockFileTier(namespace=NS, path=path, capacity=CAPACITY, min_free=0, **extra)


def first_writer(path: Path) -> None:
    """A writer that made the directory's ledger and landed a block, then left."""

    async def go() -> None:
        async with tier(path) as t:
            await t.put(make_key(bytes(32)), payload(8192, 0))

    asyncio.run(go())


def lock_down(path: Path) -> None:
    """Make `path` unwritable for this process: immutable as root, read-only bits otherwise."""
    if ROOT_USER:
        done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, check=False)
        if done.returncode != 0:
            pytest.skip(f"chattr +i not supported here: {done.stderr.decode().strip()}")
    else:
        path.chmod(0o555 if path.is_dir() else 0o444)


def release(path: Path) -> None:
    if ROOT_USER:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True, check=False)
    else:
        path.chmod(0o755 if path.is_dir() else 0o644)


@pytest.fixture
def locked(tmp_path: Path) -> Iterator[list[Path]]:
    """Paths the test locked down, released at the end (pytest must be able to remove them)."""
    paths: list[Path] = []
    yield paths
    for path in reversed(paths):
        release(path)


def assert_refused_at_start(path: Path, unwritable: Path) -> None:
    began = time.monotonic()
    with pytest.raises(ConfigError) as info:
        tier(path)
    message = str(info.value)
    assert time.monotonic() - began < 1.0
    assert "\n" not in message and str(unwritable) in message
    assert "cannot write the directory's byte count" in message
    assert "Operation not permitted" in message or "Permission denied" in message


def test_an_unwritable_ledger_fails_the_start_with_one_line(
    tmp_path: Path, locked: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """The ledger immutable: the tier's start is refused at once, naming the file; the
    ledger is left as it was; a read-only tier over the directory still opens and reads; the
    operators' commands that write exit 2 with one line."""
    path = tmp_path / "d"
    first_writer(path)
    ledger = path / ".kvtier" / "budget-v1"
    before = ledger.read_bytes()
    lock_down(ledger)
    locked.append(ledger)
    assert_refused_at_start(path, ledger)
    assert ledger.read_bytes() == before

    async def read() -> bytes | None:
        async with tier(path, read_only=True) as t:
            return await t.get_bytes(make_key(bytes(32)), 8192)

    assert asyncio.run(read()) == payload(8192, 0)

    config = tmp_path / "kvtier.yaml"
    config.write_text(
        json.dumps(
            {
                "tiers": [
                    {
                        "name": "t",
                        "type": "file",
                        "path": str(path),
                        "min_free": 0,
                        "capacity": "64MiB",
                    }
                ]
            }
        )
    )
    code = main(["verify", "--config", str(config), "--tier", "t", "--repair"])
    err = capsys.readouterr().err
    assert code == 2 and "cannot write the directory's byte count" in err
    assert len(err.strip().splitlines()) == 1, err


def test_an_unwritable_kvtier_directory_fails_the_start(tmp_path: Path, locked: list[Path]) -> None:
    """`.kvtier` there and unwritable, no ledger in it yet: no ledger can be made."""
    path = tmp_path / "d"
    meta = path / ".kvtier"
    meta.mkdir(parents=True)
    lock_down(meta)
    locked.append(meta)
    assert_refused_at_start(path, meta / "budget-v1")


CHILD = """
import json, os, sys, time
from tiering.errors import ConfigError
from tiers.file import BlockFileTier
if len(sys.argv) > 2:  # become that user, once every module is imported (root's interpreter
    os.setgroups([])  # lives where another user cannot read it)
    os.setgid(int(sys.argv[2]))
    os.setuid(int(sys.argv[2]))
began = time.monotonic()
try:
    BlockFileTier(namespace=bytes(range(90, 106)), path=sys.argv[1], capacity=64 << 20,
                  min_free=0)
    print(json.dumps({"started": True}))
except ConfigError as e:
    print(json.dumps({"error": str(e), "seconds": time.monotonic() - began}))
"""
"""A process starting a writable tier over `argv[1]` (as the user of id `argv[2]` if given):
what its start did, as JSON."""


def child_env() -> dict[str, str]:
    return os.environ | {"PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}


@pytest.mark.skipif(not ROOT_USER, reason="a private mount namespace needs root")
def test_a_directory_on_a_read_only_mount_fails_the_start(tmp_path: Path) -> None:
    """The tier's directory bind-mounted read-only in the child's own mount namespace."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not installed")
    path = tmp_path / "d"
    path.mkdir()
    script = (
        f'mount --bind "{path}" "{path}" && mount -o remount,ro,bind "{path}" && '
        f'exec "{sys.executable}" -c "$0" "{path}"'
    )
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, CHILD],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=60,
        check=False,
    )
    if done.returncode != 0 and "mount" in done.stderr:
        pytest.skip(f"no read-only bind mount here: {done.stderr.strip()}")
    result = json.loads(done.stdout)
    assert "Read-only file system" in result["error"] and str(path / ".kvtier") in result["error"]
    assert result["seconds"] < 1.0 and "\n" not in result["error"]
    assert not (path / ".kvtier").exists()


@pytest.mark.skipif(not ROOT_USER, reason="starting a process as another user needs root")
def test_another_users_ledger_is_never_replaced_and_fails_the_start() -> None:
    """root's ledger in a `.kvtier` every user may write (a shared disk): a tier started by
    `nobody` is refused with one line, and root's ledger is left, the same file, unchanged
    (before, `nobody`'s tier removed it and made its own, so root's engines stalled)."""
    base = Path(tempfile.mkdtemp(prefix="kvtier-budget-"))
    try:
        base.chmod(0o755)
        path = base / "d"
        first_writer(path)
        path.chmod(0o777)
        (path / ".kvtier").chmod(0o777)
        ledger = path / ".kvtier" / "budget-v1"
        before = (ledger.stat().st_ino, ledger.read_bytes())
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(path), str(NOBODY)],
            capture_output=True,
            text=True,
            env=child_env(),
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert "Permission denied" in result["error"] and str(ledger) in result["error"]
        assert result["seconds"] < 1.0
        assert (ledger.stat().st_ino, ledger.read_bytes()) == before
    finally:
        shutil.rmtree(base, ignore_errors=True)
