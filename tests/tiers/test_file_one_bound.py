"""One capacity per `files` directory, real processes at once: the first writer with a capacity
records it under `.kvtier`, a writer configured with another is refused at start with one line
naming both, and a writer configured with none keeps to the recorded one, its bytes counted at
once, whichever started first (`tiers/file/budget.py`: `Ledger.claim`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.file_children import PRELUDE, Children, directory_bytes
from tiers.file.budget import Ledger

_WRITER = (
    PRELUDE
    + """
from tiering.errors import ConfigError

async def main():
    size, batch = args["size"], args["batch"]
    options = {"capacity": args["capacity"]} if args["capacity"] else {}
    try:
        tier = BlockFileTier(namespace=NAMESPACE, path=args["path"], min_free=0, **options)
    except ConfigError as e:
        say(refused=str(e))
        return
    async with tier:
        say(ready=os.getpid())
        wait_for_go()
        landed = failed = 0
        i = args["first"]
        end = time.monotonic() + args["seconds"]
        while time.monotonic() < end:
            items = [(key(i + j), payload(size, i + j)) for j in range(batch)]
            results = await tier.put_many(items)
            i += batch
            landed += sum(result is None for result in results)
            failed += sum(result is not None for result in results)
        say(landed=landed, failed=failed, capacity=tier.capacity)
        while not Path(args["stop"]).exists():
            await asyncio.sleep(0.01)

asyncio.run(main())
"""
)

MiB = 1 << 20


@pytest.fixture
def children(tmp_path: Path) -> Iterator[Children]:
    made = Children(tmp_path)
    yield made
    made.close()


@pytest.mark.parametrize(
    "capacities",
    [(16 * MiB, 16 * MiB, None), (None, 16 * MiB, 16 * MiB), (16 * MiB, 16 * MiB, 64 * MiB)],
    ids=["16-16-none", "none-16-16", "16-16-64"],
)
def test_the_directory_has_one_bound_whatever_each_writer_was_configured_with(
    tmp_path: Path, children: Children, capacities: tuple[int | None, ...]
) -> None:
    """Three writer processes start on one directory in the order given, then write as fast
    as they can at once: one configured with another capacity than the first's is refused at
    start with one line naming both; one configured with none keeps to the recorded one; the
    directory, sampled from the disk throughout, never holds more than the capacity plus one
    batch, and the count covers every byte on the disk."""
    path = tmp_path / "d"
    capacity, size, batch, seconds = 16 * MiB, 256 << 10, 4, 3.0
    one_batch = batch * (size + 4096)
    writers = []
    for w, configured in enumerate(capacities):
        proc = children.start(
            _WRITER,
            path=str(path),
            capacity=configured,
            size=size,
            batch=batch,
            first=100_000 * w,
            seconds=seconds,
        )
        first = children.line(proc)
        if configured not in (None, capacity):
            refused = first["refused"]
            assert "\n" not in refused, refused
            assert str(configured) in refused and str(capacity) in refused, refused
            continue
        assert "ready" in first, first
        writers.append(proc)
    assert len(writers) == sum(c in (None, capacity) for c in capacities)
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
        reports = [children.line(w, timeout=120) for w in writers]
    finally:
        done.set()
        watcher.join()
    landed = sum(r["landed"] * (size + 4096) for r in reports)
    print(f"{capacities}: {landed / MiB:.0f} MiB landed, peak {peak[0] / MiB:.2f} MiB")
    # A writer configured with none that started before any capacity was recorded keeps to
    # it from its first grant after (its count's `Credit`); the tier's own stat says none.
    assert all(
        r["capacity"] in (capacity, None if capacities[0] is None else capacity) for r in reports
    ), reports
    assert landed > 2 * capacity  # the sweeper evicted while they wrote
    assert peak[0] <= capacity + one_batch, (peak[0], capacity)
    children.stop.touch()
    for proc in children.procs:
        proc.communicate(timeout=20)
    children.procs.clear()
    state = Ledger(path, capacity, "test").read()
    assert state is not None and state.capacity == capacity
    on_disk = sum(p.stat().st_size for p in path.rglob("*.kv"))
    assert on_disk <= state.used <= on_disk + one_batch, (state.used, on_disk)
