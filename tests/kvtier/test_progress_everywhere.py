"""Every command that can run long (migrate, verify, purge, bench, replay, plan) draws its progress
on a terminal, a real pseudo-terminal as standard error: what is done and its rate, and the
time left where the total is known; it draws nothing with `--json` on that terminal, nor when
standard error is not a terminal."""

from __future__ import annotations

import asyncio
import io
import json
import os
import pty
import sys
import threading
from pathlib import Path

import pytest

from kvtier.cli import main
from tiering.keys import BlockKey, make_key
from tiering.testing import payload
from tiers.file import BlockFileTier

NS = bytes(range(90, 106))
SIZE = 4096
BLOCKS = 40


def k(i: int) -> BlockKey:
    return make_key(i.to_bytes(32, "big"))


def setup(root: Path) -> Path:
    """A config of two file tiers, `nvme` holding BLOCKS blocks of namespace NS, and `back`."""
    root.mkdir()

    async def fill() -> None:
        async with BlockFileTier(namespace=NS, path=root / "nvme", min_free=0) as tier:
            await tier.put_many([(k(i), payload(SIZE, i)) for i in range(BLOCKS)])

    asyncio.run(fill())
    config = root / "tiers.yaml"
    config.write_text(
        "tiers:\n"
        f"  - {{name: nvme, type: file, path: '{root / 'nvme'}', min_free: 0}}\n"
        f"  - {{name: back, type: file, path: '{root / 'back'}', min_free: 0}}\n"
    )
    trace = root / "trace.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"timestamp": i, "input_length": 64, "hash_ids": [i % 7, 100 + i]}) + "\n"
            for i in range(600)
        )
    )
    return config


def commands(root: Path) -> dict[str, list[str]]:
    """Each long command, with what its progress line starts with."""
    config = str(root / "tiers.yaml")
    ns = NS.hex()
    return {
        "verify nvme: ": ["verify", "--config", config, "--tier", "nvme", "--namespace", ns],
        "migrate nvme -> back: ": [
            *("migrate", "--config", config, "--from", "nvme", "--to", "back"),
            *("--namespace", ns, "--journal", str(root / "journal")),
        ],
        "purge back: ": ["purge", "--config", config, "--tier", "back", "--namespace", ns, "--yes"],
        "bench nvme [": [
            *("bench", "--config", config, "--tier", "nvme"),
            *("--sizes", "4KiB", "--count", "16", "--clients", "2"),
        ],
        "lru @ 64 blocks [": [
            *("replay", str(root / "trace.jsonl"), "--capacity", "64", "--policy", "lru"),
        ],
        "plan [": [
            *("plan", str(root / "trace.jsonl"), "--primary", "64,128", "--policy", "lru"),
        ],
    }


class Terminal:
    """A pseudo-terminal as the process's standard error; what was drawn on it, read from the
    other end."""

    def __init__(self) -> None:
        self.master, slave = pty.openpty()
        self.stream = os.fdopen(slave, "w")
        self.drawn = bytearray()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 4096)
            except OSError:  # the slave end closed
                return
            if not chunk:
                return
            self.drawn += chunk

    def close(self) -> str:
        self.stream.close()
        self._reader.join(timeout=10)
        os.close(self.master)
        return self.drawn.decode()


def run(args: list[str], stderr: io.TextIOBase, monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as patch:
        patch.setattr(sys, "stderr", stderr)
        patch.setattr(sys, "stdout", io.StringIO())
        assert main(args) == 0, args


@pytest.mark.parametrize("mode", ["terminal", "terminal --json", "pipe"])
def test_long_commands_draw_progress_on_a_terminal_only(
    mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    setup(tmp_path / "store")
    for start, args in commands(tmp_path / "store").items():
        if mode == "pipe":
            stream = io.StringIO()
            run(args, stream, monkeypatch)
            assert stream.getvalue() == "", args
            continue
        terminal = Terminal()
        assert terminal.stream.isatty()
        run([*args, "--json"] if mode.endswith("--json") else args, terminal.stream, monkeypatch)
        drawn = terminal.close()
        if mode.endswith("--json"):
            assert drawn == "", args
            continue
        assert f"\r{start}" in drawn, (args, drawn)
        assert "/s" in drawn, (args, drawn)  # the rate
        if start.endswith("["):  # a known total: the time left while it runs
            assert " left" in drawn, (args, drawn)
        assert drawn.endswith("\r\033[K"), (args, drawn)  # the line cleared at the end
