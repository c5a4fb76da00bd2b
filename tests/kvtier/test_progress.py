"""The progress bar is drawn on a terminal and nowhere else, with its rate and the time left."""

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


def test_rate_and_time_left() -> None:
    stream = Terminal()
    now = [100.0]
    progress = Progress(1000, "copy", stream, clock=lambda: now[0])
    now[0] += 2.0
    progress.update(50)
    assert stream.getvalue().endswith("] 50/1,000  25/s  0:38 left\033[K")
    now[0] += 3598.0
    progress.update(500)  # 500 in an hour: as long again
    assert stream.getvalue().endswith("] 500/1,000  0.1/s  1:00:00 left\033[K")
    progress.update(1000)
    assert stream.getvalue().endswith("] 1,000/1,000  0.3/s\033[K")  # done: no time left


def test_an_unknown_total_draws_the_count_and_its_rate() -> None:
    stream = Terminal()
    now = [0.0]
    progress = Progress(0, "verify nvme", stream, clock=lambda: now[0])
    now[0] = 4.0
    progress.update(1200)
    assert stream.getvalue() == "\rverify nvme: 1,200  300/s\033[K"


def test_quiet_draws_nothing_on_a_terminal() -> None:
    stream = Terminal()
    progress = Progress(10, "x", stream, quiet=True)
    progress.update(5)
    progress.close()
    assert stream.getvalue() == ""
