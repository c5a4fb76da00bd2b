"""Engines of a fleet handing the turns of conversations to one another through a directory.

An engine process's main thread (`connectors.vllm.run`, the scenario's `fleet` key): several
engines run at once, each serves the turns a schedule gives it, and a turn whose conversation
another engine served before waits until that engine has published it: the conversation so far
(its prompts and answers), once the engine has stepped until its stores and write-through
demotions ended, so its blocks are in the shared store. Files in one directory, each written
whole and renamed into place, are the only channel: no engine reads another's half-written
turn, and the directory is all a failed run leaves to look at.

Barriers (`ready` after each engine's warm-up, `done` after its last turn) make the engines
serve their first turns together and keep every engine up until all have served theirs: a
block one engine finds was stored by another engine still running. Every wait is bounded; its
end is a `RendezvousTimeout` naming what was waited for.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["Rendezvous", "RendezvousTimeout", "serve"]

POLL = 0.01
"""Seconds between two looks at the directory while waiting."""


class RendezvousTimeout(RuntimeError):
    """A wait for another engine outlived the fleet's `timeout`."""


class Rendezvous:
    """One engine's view of the fleet's directory (the engine's main thread)."""

    def __init__(self, directory: Path, engine: int, engines: int, timeout: float) -> None:
        if not 0 <= engine < engines:
            raise ValueError(f"fleet: engine {engine} of {engines}: expected 0 to {engines - 1}")
        self.directory = directory
        self.engine = engine
        self.engines = engines
        self.timeout = timeout
        directory.mkdir(parents=True, exist_ok=True)

    def arrive(self, barrier: str) -> float:
        """Say this engine reached `barrier`, then wait until every engine has; the seconds
        waited."""
        self._write(f"{barrier}.{self.engine}", {"at": time.time()})
        names = [f"{barrier}.{e}" for e in range(self.engines)]
        began = time.monotonic()
        self._wait(lambda: all((self.directory / n).exists() for n in names), f"barrier {barrier}")
        return time.monotonic() - began

    def publish(self, conversation: int, turn: int, history: Sequence[int]) -> None:
        """`history`, conversation `conversation` after its turn `turn` (prompt and answer),
        for the engine that serves the next turn."""
        self._write(_turn(conversation, turn), {"history": list(history), "at": time.time()})

    def wait(self, conversation: int, turn: int) -> tuple[list[int], float]:
        """The history another engine published after turn `turn` of `conversation`, and when
        it did (Unix seconds), once it has."""
        path = self.directory / _turn(conversation, turn)
        self._wait(path.exists, f"turn {turn} of conversation {conversation}")
        record = json.loads(path.read_text())
        return [int(t) for t in record["history"]], float(record["at"])

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not ready():
            if time.monotonic() > deadline:
                raise RendezvousTimeout(
                    f"fleet: engine {self.engine} of {self.engines} waited {self.timeout:g} s "
                    f"for {what} in {self.directory}"
                )
            time.sleep(POLL)

    def _write(self, name: str, record: dict[str, Any]) -> None:
        path = self.directory / name
        partial = path.with_name(f".{name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(record))
        os.replace(partial, path)


def _turn(conversation: int, turn: int) -> str:
    return f"conversation-{conversation}.turn-{turn}.json"


def serve(
    fleet: dict[str, Any],
    conversations: Sequence[Sequence[Sequence[int]]],
    generate: Callable[[list[int], dict[str, Any]], list[int]],
    settle: Callable[[], None],
) -> None:
    """Serve this engine's turns of `conversations` (each a list of user messages) as the
    scenario's `fleet` says: `dir` (the fleet's directory), `engine` (this engine's index),
    `engines` (how many), `turns` (this engine's `[conversation, turn]` pairs, in order),
    `think` (seconds a turn starts at the earliest after the turn before it was published,
    default 0: time for a store whose blocks are seen late, an S3 pack waiting to be written,
    to show them), `timeout` (of each wait, default 300 s).

    `generate(prompt, labels)` serves a prompt and returns its answer (`labels`: what to
    record with it: `conversation`, `turn`, `waited`, the seconds this turn waited for the
    turn before it); `settle()` steps the engine until its stores and demotions have ended."""
    rendezvous = Rendezvous(
        Path(fleet["dir"]), int(fleet["engine"]), int(fleet["engines"]), fleet.get("timeout", 300)
    )
    think = float(fleet.get("think", 0.0))
    rendezvous.arrive("ready")
    for conversation, turn in fleet["turns"]:
        history: list[int] = []
        began = time.monotonic()
        if turn > 0:
            history, at = rendezvous.wait(conversation, turn - 1)
            time.sleep(max(0.0, at + think - time.time()))
        history += conversations[conversation][turn]
        labels = {"conversation": conversation, "turn": turn, "waited": time.monotonic() - began}
        history += generate(history, labels)
        settle()
        rendezvous.publish(conversation, turn, history)
    rendezvous.arrive("done")
