"""connectors/rendezvous.py: engines handing conversations to one another through a directory,
here as real processes at the same time, each with a stand-in for its engine (the answer to a
prompt is its length and its last token, so a wrong history changes every later answer)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from connectors.rendezvous import Rendezvous, RendezvousTimeout, serve
from tests.helpers.paths import ROOT

ENGINE = """
import json, sys, time
from connectors.rendezvous import serve

fleet, conversations, out = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
served, settled = [], []

def generate(prompt, labels):
    time.sleep(0.02)  # long enough for the others to run meanwhile
    served.append({"prompt": list(prompt), **labels, "at": time.time()})
    return [len(prompt), prompt[-1]]

serve(fleet, conversations, generate, lambda: settled.append(len(served)))
with open(out, "w") as f:
    json.dump({"served": served, "settled": settled, "ended": time.time()}, f)
"""


def answer(prompt: list[int]) -> list[int]:
    return [len(prompt), prompt[-1]]


def engines_at_once(tmp_path: Path, fleets: list[dict[str, Any]], conversations: Any) -> list[Any]:
    procs = []
    for i, fleet in enumerate(fleets):
        out = tmp_path / f"engine-{i}.json"
        argv = [sys.executable, "-c", ENGINE, json.dumps(fleet), json.dumps(conversations)]
        procs.append((subprocess.Popen([*argv, str(out)], cwd=ROOT), out))
    for proc, _ in procs:
        assert proc.wait(timeout=60) == 0
    return [json.loads(out.read_text()) for _, out in procs]


def test_each_turn_continues_the_conversation_another_engine_served(tmp_path: Path) -> None:
    conversations = [[[10 * c + t + 3] * (t + 2) for t in range(3)] for c in range(3)]
    schedule: list[list[list[int]]] = [[], [], []]
    for t in range(3):
        for c in range(3):
            schedule[(c + t) % 3].append([c, t])
    fleets = [
        {"dir": str(tmp_path / "fleet"), "engine": e, "engines": 3, "turns": turns}
        for e, turns in enumerate(schedule)
    ]
    results = engines_at_once(tmp_path, fleets, conversations)

    for c, messages in enumerate(conversations):  # the prompts one engine alone would see
        history: list[int] = []
        for t, message in enumerate(messages):
            history += message
            (got,) = [
                s for r in results for s in r["served"] if (s["conversation"], s["turn"]) == (c, t)
            ]
            assert got["prompt"] == history
            history += answer(history)
    for result, turns in zip(results, schedule, strict=True):
        assert [[s["conversation"], s["turn"]] for s in result["served"]] == turns
        assert result["settled"] == list(range(1, len(turns) + 1))  # settled before each handover
    # Each engine stayed up until every engine had served its last turn.
    last = max(s["at"] for r in results for s in r["served"])
    assert all(r["ended"] >= last for r in results)


def test_a_returning_turn_waits_the_think_time_after_the_turn_before(tmp_path: Path) -> None:
    conversations = [[[5, 6], [7]]]
    fleets = [
        {"dir": str(tmp_path / "fleet"), "engine": e, "engines": 2, "turns": [[0, e]], "think": 1.0}
        for e in range(2)
    ]
    first, second = engines_at_once(tmp_path, fleets, conversations)
    (turn0,), (turn1,) = first["served"], second["served"]
    assert turn1["at"] - turn0["at"] >= 1.0
    assert turn1["waited"] >= 0.9


def test_a_wait_for_an_engine_that_never_comes_ends_with_what_it_waited_for(
    tmp_path: Path,
) -> None:
    rendezvous = Rendezvous(tmp_path / "fleet", 0, 2, timeout=0.3)
    began = time.monotonic()
    with pytest.raises(RendezvousTimeout, match=r"engine 0 of 2 waited 0.3 s for barrier ready"):
        rendezvous.arrive("ready")
    with pytest.raises(RendezvousTimeout, match="for turn 1 of conversation 4"):
        rendezvous.wait(4, 1)
    assert time.monotonic() - began < 2


def test_a_turn_is_read_whole_or_not_at_all(tmp_path: Path) -> None:
    """Nothing but the published record under a turn's name: a writer's partial file has
    another name until it is complete."""
    directory = tmp_path / "fleet"
    writer, reader = Rendezvous(directory, 0, 2, 5), Rendezvous(directory, 1, 2, 5)
    writer.publish(2, 0, list(range(100_000)))
    history, at = reader.wait(2, 0)
    assert history == list(range(100_000)) and at <= time.time()
    assert [p.name for p in directory.iterdir()] == ["conversation-2.turn-0.json"]


def test_an_engine_outside_the_fleet_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="engine 3 of 3: expected 0 to 2"):
        serve({"dir": str(tmp_path), "engine": 3, "engines": 3, "turns": []}, [], None, None)  # type: ignore[arg-type]
