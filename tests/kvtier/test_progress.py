"""The progress bar is drawn on a terminal and nowhere else."""

from __future__ import annotations

import io

from kvtier.cli.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_draws_on_a_terminal() -> None:
    stream = Terminal()
    progress = Progress(200, "lru @ 8 blocks", stream)
    progress.update(100)
    progress.update(200)
    progress.close()
    text = stream.getvalue()
    assert "\rlru @ 8 blocks [###############...............] 100/200" in text
    assert "[##############################] 200/200" in text
    assert text.endswith("\r\033[K")


def test_silent_elsewhere() -> None:
    stream = io.StringIO()
    progress = Progress(10, "x", stream)
    progress.update(5)
    progress.close()
    assert stream.getvalue() == ""
