"""A progress line on standard error, shown only when it is a terminal and JSON is not asked
for."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """The `kvtier` process's main thread: draws `label [#####.....] done/total  rate/s  m:ss
    left` (a count and its rate when the total is unknown) at most ten times a second.

    Disabled (every call a no-op) unless the stream is a terminal, and when `quiet` (a command's
    `--json`: its output is for a program), so logs, pipes and JSON stay clean.
    """

    def __init__(
        self,
        total: int,
        label: str,
        stream: TextIO | None = None,
        *,
        quiet: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`total` 0 when unknown: a count is drawn instead of a bar, and no time left."""
        self.known = total > 0
        self.total = max(total, 1)
        self.label = label
        self.stream = sys.stderr if stream is None else stream
        self.enabled = not quiet and self.stream.isatty()
        self.clock = clock
        self._start = clock()
        self._last: float | None = None

    @classmethod
    def of(cls, args: argparse.Namespace, total: int, label: str) -> Progress:
        """A command's progress: quiet under `--json`."""
        return cls(total, label, quiet=bool(getattr(args, "json", False)))

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        now = self.clock()
        finished = self.known and done >= self.total
        if self._last is not None and now - self._last < 0.1 and not finished:
            return
        self._last = now
        elapsed = now - self._start
        rate = done / elapsed if elapsed > 0 else 0.0
        speed = f"  {_figure(rate)}/s" if rate else ""
        if not self.known:
            self.stream.write(f"\r{self.label}: {done:,}{speed}\033[K")
            self.stream.flush()
            return
        width = 30
        filled = width * min(done, self.total) // self.total
        bar = "#" * filled + "." * (width - filled)
        left = ""
        if rate and not finished:
            left = f"  {_duration((self.total - done) / rate)} left"
        self.stream.write(f"\r{self.label} [{bar}] {done:,}/{self.total:,}{speed}{left}\033[K")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r\033[K")
            self.stream.flush()


def _figure(rate: float) -> str:
    return f"{rate:,.0f}" if rate >= 10 else f"{rate:.1f}"


def _duration(seconds: float) -> str:
    """`m:ss`, or `h:mm:ss` from an hour."""
    whole = int(seconds + 0.5)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02}:{secs:02}" if hours else f"{minutes}:{secs:02}"
