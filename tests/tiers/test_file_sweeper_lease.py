"""A `files` directory's sweeper that stops (SIGSTOP: a paused container, a debugger, a hung
disk) loses its role within the lease (`tiers/file/lease.py`), real processes at once: the
other writers keep landing puts and the directory stays within its capacity plus one batch;
resumed, the stopped one gives the role up without evicting beyond the new sweeper's work or
losing bytes from the count."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.file_children import IDLE, PRELUDE, Children, directory_bytes
from tiers.file.budget import Ledger
from tiers.file.lease import LEASE
from tiers.file.locks import read_holder
from tiers.file.sweeper import LOW, ROLE_EVERY

_TIMED_WRITER = (
    PRELUDE
    + """
async def main():
    size, batch = args["size"], args["batch"]
    async with BlockFileTier(
        namespace=NAMESPACE, path=args["path"], min_free=0, capacity=args["capacity"]
    ) as tier:
        say(ready=os.getpid())
        wait_for_go()
        landed, failed, i = [], [], args["first"]
        end = time.monotonic() + args["seconds"]
        while time.monotonic() < end:
            items = [(key(i + j), payload(size, i + j)) for j in range(batch)]
            results = await tier.put_many(items)
            now = time.time()
            i += batch
            for result in results:
                (landed if result is None else failed).append(now)
        say(landed=landed, failed=failed)
        while not Path(args["stop"]).exists():
            await asyncio.sleep(0.01)

asyncio.run(main())
"""
)


@pytest.fixture
def children(tmp_path: Path) -> Iterator[Children]:
    made = Children(tmp_path)
    yield made
    made.close()


def test_a_stopped_sweeper_loses_its_role_and_the_others_keep_writing(
    tmp_path: Path, children: Children
) -> None:
    """The elected sweeper (a real process) is stopped for `stopped` seconds while two writer
    processes fill the directory: within the lease plus one try the role is another's, the
    writers land puts in the rest of the stop, the directory never holds more than its
    capacity plus one batch, and once the stopped one resumes it gives the role up, the
    directory is not swept far below the sweep's floor, and the count still covers every
    byte on the disk."""
    path = tmp_path / "d"
    capacity, size, batch = 4 << 20, 64 << 10, 4
    one_batch = batch * (size + 4096)
    warm, stopped, after = 1.5, 2 * LEASE + 1.5, 1.5
    sweeper = children.start(IDLE, path=str(path), capacity=capacity)
    sweeper_pid = children.line(sweeper)["ready"]
    lock_file = path / ".kvtier" / "sweeper.lock"
    assert read_holder(lock_file).startswith(f"pid {sweeper_pid} ")
    writers = [
        children.start(
            _TIMED_WRITER,
            path=str(path),
            capacity=capacity,
            size=size,
            batch=batch,
            first=100_000 * w,
            seconds=warm + stopped + after,
        )
        for w in range(2)
    ]
    for w in writers:
        children.line(w)
    samples: list[tuple[float, int]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            samples.append((time.time(), directory_bytes(path)))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        children.release()
        time.sleep(warm)
        os.kill(sweeper_pid, signal.SIGSTOP)
        stop_at = time.time()
        try:
            time.sleep(stopped)
        finally:
            os.kill(sweeper_pid, signal.SIGCONT)
        resumed_at = time.time()
        holder_at_resume = read_holder(lock_file)
        reports = [children.line(w, timeout=120) for w in writers]
    finally:
        done.set()
        watcher.join()
    moved_by = stop_at + LEASE + ROLE_EVERY + 0.5  # the lease, a try, and a loaded machine
    landed = [t for r in reports for t in r["landed"]]
    failed = [t for r in reports for t in r["failed"]]
    in_stop = sum(moved_by <= t <= resumed_at for t in landed)
    before = sum(stop_at - warm <= t < stop_at for t in landed)
    print(
        f"puts landed: {before} in the {warm:g}s before the stop, {in_stop} in the last "
        f"{resumed_at - moved_by:.1f}s of the {stopped:g}s stop; {len(failed)} TierFull; "
        f"peak {max(b for _, b in samples)} of {capacity}"
    )
    assert not holder_at_resume.startswith(f"pid {sweeper_pid} "), holder_at_resume
    assert in_stop >= 8 * batch, (in_stop, before)
    assert not [t for t in failed if t >= moved_by], len(failed)
    peak = max(b for _, b in samples)
    assert peak <= capacity + one_batch, (peak, capacity)
    # Resumed, it gives the role up; nobody sweeps the directory far below the sweep's floor
    # (two sweepers fighting would each remove the excess).
    floor = min(b for t, b in samples if t >= resumed_at + 0.2) if after > 0.2 else capacity
    assert floor >= capacity * LOW - 2 * one_batch - 3 * (capacity // 64), (floor, capacity)
    time.sleep(0.5)  # the resumed one's next tick
    assert not read_holder(lock_file).startswith(f"pid {sweeper_pid} ")
    children.stop.touch()
    err = {proc.pid: proc.communicate(timeout=20)[1] for proc in children.procs}
    children.procs.clear()
    assert "giving the role up" in err[sweeper_pid], err[sweeper_pid]
    state = Ledger(path, capacity, "test").read()
    assert state is not None
    on_disk = sum(p.stat().st_size for p in path.rglob("*.kv"))
    assert on_disk <= state.used <= on_disk + one_batch, (state.used, on_disk)
