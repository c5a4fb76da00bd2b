"""The traffic recorder (`trace.record`, `tiering.manager.traffic`): salted ids, rotation, a
full queue, failed writes, and the files `kvtier replay` reads."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier.replay import ReplayEngine
from kvtier.trace import load_trace
from tiering.config import TraceConfig, parse_config
from tiering.keys import BlockKey, make_key
from tiering.manager.traffic import MISS, PRIMARY, TrafficRecorder


def key(i: int) -> BlockKey:
    return make_key(i.to_bytes(32, "big"))


def lines(path: Path | str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def recorder(path: Path | str, max_bytes: int = 1 << 20, keep: int = 2, **kw: Any) -> Any:
    return TrafficRecorder(TraceConfig(str(path), max_bytes, keep), 16, **kw)


def test_equal_keys_equal_ids_within_a_file_and_unrelated_across_files(tmp_path: Path) -> None:
    files = []
    for name in ("a.jsonl", "b.jsonl"):
        r = recorder(tmp_path / name)
        r.record([key(1), key(2)])
        r.record([key(1), key(3)], tokens=40)
        r.close()
        files.append(lines(tmp_path / name))
    a, b = files
    assert a[0]["hash_ids"][0] == a[1]["hash_ids"][0]  # a shared prefix stays shared
    assert len({a[0]["hash_ids"][0], a[0]["hash_ids"][1], a[1]["hash_ids"][1]}) == 3
    assert not set(a[0]["hash_ids"] + a[1]["hash_ids"]) & set(b[0]["hash_ids"] + b[1]["hash_ids"])
    raw = (tmp_path / "a.jsonl").read_bytes()
    for k in (key(1), key(2), key(3)):  # no key, in any spelling, leaves the engine
        assert k.hex().encode() not in raw and k[-8:] not in raw
        assert str(int.from_bytes(k[-8:], "big")).encode() not in raw
    assert a[0]["input_length"] == 2 * 16 and a[1]["input_length"] == 40
    assert a[0]["block_tokens"] == 16 and a[0]["found"] == [MISS, MISS]
    assert all(0 <= i < 1 << 63 for i in a[0]["hash_ids"])
    assert a[0]["timestamp"] <= a[1]["timestamp"]


def test_answers_say_where_each_block_was_found(tmp_path: Path) -> None:
    r = recorder(tmp_path / "t.jsonl")
    r.answer(key(1), PRIMARY)
    r.answer(key(2), "nvme")
    r.answer(key(2), PRIMARY)  # the promoted block's second lookup: the first answer stays
    r.record([key(1), key(2), key(3)], tokens=100, engine_blocks=2)
    r.close()
    (line,) = lines(tmp_path / "t.jsonl")
    assert line["found"] == [PRIMARY, "nvme", MISS]
    assert line["engine_blocks"] == 2 and line["input_length"] == 100 - 2 * 16
    assert r.answers == []


def test_rotation_keeps_n_files_each_under_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"an earlier run": 1}\n')
    r = recorder(path, max_bytes=4096, keep=2)
    for i in range(400):
        r.record([key(i), key(i + 1), key(i + 2)])
    r.close()
    assert r.written == 400 and r.failed == 0 and r.dropped == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl", "t.jsonl.1", "t.jsonl.2"]
    for p in tmp_path.iterdir():
        assert 0 < p.stat().st_size <= 4096
        assert len(load_trace(p).requests) == len(lines(p))
    # Each file its own salt: the key every line of the newest file shares with its neighbour
    # is unrelated to the ids of the file before.
    newest, older = lines(path), lines(f"{path}.1")
    assert not {i for line in newest for i in line["hash_ids"]} & {
        i for line in older for i in line["hash_ids"]
    }


def test_a_full_queue_drops_and_counts_and_never_waits(tmp_path: Path) -> None:
    fifo = tmp_path / "t.jsonl"
    os.mkfifo(fifo)  # opening it for writing blocks the writer until a reader comes
    r = recorder(fifo, queue=3)
    r.record([key(0)])
    until(lambda: not r._queue)  # the writer took it and waits in open()
    start = time.monotonic()
    for i in range(1, 10):
        r.record([key(i)])
    assert time.monotonic() - start < 0.5
    assert r.dropped == 6 and len(r._queue) == 3
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    r.close()
    reader.join(5)
    assert r.written == 4 and len(got[0].splitlines()) == 4


@pytest.mark.parametrize("where", ["removed", "full"])
def test_a_failed_write_is_counted_never_raised(tmp_path: Path, where: str) -> None:
    if where == "full":
        path = "/dev/full"  # every write: ENOSPC, as a full disk
        if not os.access(path, os.W_OK):
            pytest.skip("no writable /dev/full here")
    else:
        path = str(tmp_path / "gone" / "t.jsonl")  # its directory is not there
    r = recorder(path)
    for i in range(5):
        r.record([key(i)])
    r.close()
    assert r.failed == 5 and r.written == 0 and r.dropped == 0


def test_the_manager_survives_a_vanished_trace_directory(tmp_path: Path) -> None:
    """Through the manager: while the trace's directory is gone every request's write fails
    and is counted, the engine serving on; once it is back, recording goes on."""
    path = tmp_path / "rec" / "t.jsonl"
    config = parse_config({"trace": {"record": str(path)}})
    engine = ReplayEngine(config, 8, 64)
    snapshot = engine.manager.snapshot
    try:
        for keys in ([key(1), key(2)], [key(1), key(2), key(3)]):
            admitted = engine.admit(keys)
            engine.serve(keys, admitted)
            engine.step()
        assert admitted.hits == 2
        until(lambda: snapshot()["manager"]["trace_failed"] == 2)
        path.parent.mkdir()
        engine.admit([key(1)])
        until(lambda: snapshot()["manager"]["trace_written"] == 1)
    finally:
        engine.close()
    (line,) = lines(path)
    assert line["found"] == [PRIMARY]


def test_the_manager_names_the_tier_it_promoted_from(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    config = parse_config(
        {
            "trace": {"record": str(path)},
            "promotion": {"gate": "always"},
            "tiers": [{"name": "ram", "type": "memory", "write": "through"}],
        }
    )
    engine = ReplayEngine(config, 4, 64)
    try:
        for keys in ([key(1), key(2)], [key(3), key(4), key(5), key(6)], [key(1), key(2)]):
            admitted = engine.admit(keys)
            engine.serve(keys, admitted)
            engine.step()
    finally:
        engine.close()
    found = [line["found"] for line in lines(path)]
    assert found == [[MISS, MISS], [MISS] * 4, ["ram", "ram"]]
