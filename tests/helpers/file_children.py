"""Child processes on one file tier directory, for the tests of neighbours sharing it (test
process; the children are separate Python processes): the script prelude they share, an idle
tier holder, the `Children` that start them together and read what they say, and the bytes a
directory holds on disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from tests.helpers.paths import ROOT

__all__ = ["IDLE", "PRELUDE", "Children", "directory_bytes"]

# The child processes' side. Each prints one JSON line when ready and one when done; `go` is
# a file whose existence starts them together.
PRELUDE = """
import asyncio, json, os, sys, time
from pathlib import Path
from tiers.file import BlockFileTier, SegmentFileTier
from tiering.testing import NAMESPACE, key, payload
args = json.loads(sys.argv[1])

def say(**what):
    print(json.dumps(what), flush=True)

def wait_for_go():
    go = Path(args["go"])
    while not go.exists():
        time.sleep(0.002)
"""

IDLE = (
    PRELUDE
    + """
async def main():
    kind = SegmentFileTier if args.get("layout") == "segments" else BlockFileTier
    options = {"capacity": args["capacity"]} if args.get("capacity") else {}
    async with kind(namespace=NAMESPACE, path=args["path"], min_free=0, **options) as tier:
        await asyncio.sleep(0.05)
        say(ready=os.getpid())
        while not Path(args["stop"]).exists():
            await asyncio.sleep(0.01)

asyncio.run(main())
"""
)


class Children:
    """Child processes running one of the scripts above; killed at the end of the test."""

    def __init__(self, tmp_path: Path) -> None:
        self.go = tmp_path / "go"
        self.stop = tmp_path / "stop"
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, script: str, **args: Any) -> subprocess.Popen[str]:
        args = {"go": str(self.go), "stop": str(self.stop), **args}
        proc = subprocess.Popen(
            [sys.executable, "-c", script, json.dumps(args)],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.procs.append(proc)
        return proc

    @staticmethod
    def line(proc: subprocess.Popen[str], timeout: float = 60) -> dict[str, Any]:
        """The child's next JSON line (its stderr on failure)."""
        got: list[str] = []
        reader = threading.Thread(target=lambda: got.append(proc.stdout.readline()))  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout)
        if not got or not got[0]:
            proc.kill()
            raise AssertionError(f"child said nothing: {proc.communicate(timeout=10)[1]}")
        return dict(json.loads(got[0]))

    def release(self) -> None:
        self.go.touch()

    def close(self) -> None:
        self.stop.touch()
        for proc in self.procs:
            try:
                proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


def directory_bytes(path: Path) -> int:
    """Bytes of every regular file under `path`, from the disk (files come and go meanwhile)."""
    total = 0
    for parent, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(parent, name)).st_size
            except FileNotFoundError:
                continue
    return total
