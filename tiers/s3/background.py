"""One long-running task of the S3 tier (`Background`), on the runtime's event loop: the pack
writer, the pack index's refresher, the sweeper each run as one.

A tier's calls run on the loop that owns it (the runtime's, or an operator command's
`asyncio.run`), so a task is started on the loop of the call that needs it, and started again
there when it ended (a bug it logged) or was left on another loop (a closed one). No caller's
deadline reaches it: it is never awaited by a call, only by `stop`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

__all__ = ["Background"]

log = logging.getLogger(__name__)


class Background:
    """A named background coroutine, started by `ensure` and ended by `stop` (runtime's
    event loop)."""

    def __init__(self, name: str, body: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """`name`: for messages; `body`: makes the coroutine to run (called at each start)."""
        self.name = name
        self.body = body
        self.task: asyncio.Task[None] | None = None

    def ensure(self) -> bool:
        """Start the task on the running loop unless it runs there already: whether it was
        started now."""
        task = self.task
        loop = asyncio.get_running_loop()
        if task is not None and not task.done() and task.get_loop() is loop:
            return False
        self.task = loop.create_task(self.body(), name=self.name)
        self.task.add_done_callback(self._ended)
        return True

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    async def stop(self) -> None:
        """Cancel the task and wait for it to end (when it runs on this loop)."""
        task, self.task = self.task, None
        if task is None or task.done():
            return
        task.cancel()
        if task.get_loop() is asyncio.get_running_loop():
            await asyncio.wait([task])

    def _ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error(
                "%s ended by an error; started again at the next call",
                self.name,
                exc_info=task.exception(),
            )
