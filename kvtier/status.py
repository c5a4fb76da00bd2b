"""One line on standard error that says what a long job is doing (`kvtier demo`'s engines, the
preparation of vLLM's environment).

On a terminal the line is redrawn in place; anywhere else (a pipe, a log file, CI, pytest's
capture) each new status is a line of its own, so a log shows the job's steps without a
redraw per tick.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import TextIO

__all__ = ["StatusLine", "elapsed"]


def elapsed(seconds: float) -> str:
    """`42 s`, `3 min 05 s`: how long a job has been running, for a person."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole} s"
    return f"{whole // 60} min {whole % 60:02d} s"


class StatusLine:
    """The `kvtier` process's main thread: shows `prefix: status`, on `stream` (standard error
    by default).

    On a terminal each `show` redraws the line (at most ten times a second, the last status
    always) and `close` clears it. Elsewhere a status is written as a line when its text
    differs from the last one written, or, with `every`, when that many seconds have passed
    since (a step that runs for minutes still shows it is alive: `show` gets the elapsed time
    in `suffix`, which does not count as a change).
    """

    def __init__(
        self, prefix: str, stream: TextIO | None = None, *, every: float | None = None
    ) -> None:
        self.prefix = prefix
        self.stream = sys.stderr if stream is None else stream
        self.every = every
        self.terminal = self.stream.isatty()
        self._text: str | None = None
        self._written = 0.0

    def show(self, text: str, suffix: str = "") -> None:
        now = time.monotonic()
        line = f"{self.prefix}: {text}" + (f" ({suffix})" if suffix else "")
        if self.terminal:
            if text == self._text and now - self._written < 0.1:
                return
            width = shutil.get_terminal_size().columns - 1  # a wrapped line is not redrawn
            self.stream.write(f"\r{line[:width]}\033[K")  # clears a longer previous line's end
        else:
            due = self.every is not None and now - self._written >= self.every
            if text == self._text and not due:
                return
            self.stream.write(line + "\n")
        self.stream.flush()
        self._text = text
        self._written = now

    def close(self) -> None:
        """Clear the line on a terminal (what the job prints next starts on a clean line)."""
        if self.terminal and self._text is not None:
            self.stream.write("\r\033[K")
            self.stream.flush()
        self._text = None
