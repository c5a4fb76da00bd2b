"""A progress bar on standard error, shown only when it is a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """The `kvtier` process's main thread: draws `label [#####.....] done/total` at most ten
    times a second.

    Disabled (every call a no-op) unless the stream is a terminal, so logs and pipes stay clean.
    """

    def __init__(self, total: int, label: str, stream: TextIO | None = None) -> None:
        """`total` 0 when unknown: a count is drawn instead of a bar."""
        self.known = total > 0
        self.total = max(total, 1)
        self.label = label
        self.stream = sys.stderr if stream is None else stream
        self.enabled = self.stream.isatty()
        self._last = 0.0

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < 0.1 and (done < self.total or not self.known):
            return
        self._last = now
        if not self.known:
            self.stream.write(f"\r{self.label}: {done:,}")
            self.stream.flush()
            return
        width = 30
        filled = width * min(done, self.total) // self.total
        bar = "#" * filled + "." * (width - filled)
        self.stream.write(f"\r{self.label} [{bar}] {done:,}/{self.total:,}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r\033[K")
            self.stream.flush()
