"""With `auth.secret`, a `files` directory's byte count is authenticated (`tiers/file/budget.py`:
`ledger_key`): a stranger who can write the directory and rewrites the count with a valid
checksum and `used` 0 does not lift the bound, real processes at once. Without a secret the
checksum is not authentication (DESIGN.md, "A bounded directory")."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.file_children import PRELUDE, Children, directory_bytes

_WRITER = (
    PRELUDE
    + """
from tiering.testing import SECRET

async def main():
    size, batch = args["size"], args["batch"]
    async with BlockFileTier(
        namespace=NAMESPACE, path=args["path"], min_free=0, capacity=args["capacity"],
        secret=SECRET,
    ) as tier:
        say(ready=os.getpid())
        wait_for_go()
        landed, i = 0, 0
        end = time.monotonic() + args["seconds"]
        while time.monotonic() < end:
            items = [(key(i + j), payload(size, i + j)) for j in range(batch)]
            results = await tier.put_many(items)
            i += batch
            landed += sum(result is None for result in results)
        say(landed=landed)
        while not Path(args["stop"]).exists():
            await asyncio.sleep(0.01)

asyncio.run(main())
"""
)

_FORGER = (
    PRELUDE
    + """
import fcntl
from tiers.file.budget import LedgerState

say(ready=os.getpid())
wait_for_go()
path = Path(args["path"]) / ".kvtier" / "budget-v1"
forged = LedgerState(used=0, capacity=args["capacity"]).encode()  # a valid checksum
end = time.monotonic() + args["seconds"]
while time.monotonic() < end and not Path(args["stop"]).exists():
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.pwrite(fd, forged, 0)
    finally:
        os.close(fd)
    time.sleep(0.5)
say(done=True)
"""
)


@pytest.fixture
def children(tmp_path: Path) -> Iterator[Children]:
    made = Children(tmp_path)
    yield made
    made.close()


def test_a_forged_count_does_not_lift_the_bound_of_a_directory_with_a_secret(
    tmp_path: Path, children: Children
) -> None:
    """A writer process with a secret fills a directory with a small capacity while a forger
    process rewrites the count with `used` 0 (a valid checksum, no MAC) every 0.5 s: sampled
    from the disk throughout, the directory never holds more than its capacity plus one
    batch, and the writer still lands puts."""
    path = tmp_path / "d"
    capacity, size, batch, seconds = 4 << 20, 64 << 10, 4, 4.0
    one_batch = batch * (size + 4096)
    writer = children.start(
        _WRITER, path=str(path), capacity=capacity, size=size, batch=batch, seconds=seconds
    )
    children.line(writer)
    forger = children.start(_FORGER, path=str(path), capacity=capacity, seconds=seconds)
    children.line(forger)
    peak = [0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], directory_bytes(path))
            time.sleep(0.003)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        children.release()
        report = children.line(writer, timeout=60)
        assert children.line(forger, timeout=30) == {"done": True}
    finally:
        done.set()
        watcher.join()
    print(f"landed {report['landed']} puts; peak {peak[0]} of {capacity}")
    assert report["landed"] * (size + 4096) > capacity  # it wrote past a full directory
    assert peak[0] <= capacity + one_batch, (peak[0], capacity)
