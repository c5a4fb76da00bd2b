"""A recorded lookup stream replays (`trace.record`): the real manager, driven in-process as
vLLM's connector drives it (`kvtier.replay.ReplayEngine`), records a slice of the shipped trace,
and `kvtier replay` of the recorded file at the same primary capacity and policy finds the hits
the manager answered, request by request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.replay import ReplayEngine
from kvtier.trace import BLOCK_TOKENS, load_trace, trace_keys
from tiering.config import parse_config
from tiering.errors import TraceError

REQUESTS = 600
CAPACITY = 1500


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_recorded_stream_replays_to_the_managers_hits(
    tmp_path: Path, mooncake_trace: Path, policy: str, capsys: pytest.CaptureFixture[str]
) -> None:
    requests = load_trace(mooncake_trace).requests[:REQUESTS]
    path = tmp_path / "recorded.jsonl"
    config = parse_config({"primary": {"eviction": policy}, "trace": {"record": str(path)}})
    engine = ReplayEngine(config, CAPACITY, 64)
    hits = []
    try:
        for keys in trace_keys(requests):
            admitted = engine.admit(keys)
            engine.serve(keys, admitted)
            engine.step()
            hits.append(admitted.hits)
    finally:
        engine.close()
    assert engine.manager.snapshot()["manager"]["trace_written"] == REQUESTS
    recorded = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["found"].count("primary") for line in recorded] == hits
    assert [len(line["hash_ids"]) for line in recorded] == [len(r.hash_ids) for r in requests]

    assert (
        main(["replay", str(path), "--capacity", str(CAPACITY), "--policy", policy, "--json"]) == 0
    )
    (row,) = json.loads(capsys.readouterr().out)["results"]
    measured = hits[REQUESTS // 2 :]
    assert sum(measured) > 0
    assert row["hit_tokens"] == BLOCK_TOKENS * sum(measured)


def test_a_recorded_lines_block_tokens_give_each_blocks_tokens(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    line = {"input_length": 40, "hash_ids": [1, 2, 3], "block_tokens": 16, "found": ["miss"] * 3}
    path.write_text(json.dumps(line) + "\n" + json.dumps({**line, "block_tokens": 0}) + "\n")
    with pytest.raises(TraceError, match="t.jsonl:2: block_tokens must be an integer"):
        load_trace(path)
    path.write_text(json.dumps(line) + "\n")
    assert load_trace(path).requests[0].block_tokens() == [16, 16, 8]
