"""The traffic recorder: `record` on the scheduler's thread (a bounded queue, never a wait),
and a writer thread of its own that hashes, encodes and writes (`trace.record`), draining the
queue every `INTERVAL` in one batch (woken per request, it took the GIL from the scheduler in
the middle of its steps: BENCHMARKS.md, "Recording traffic").

It turns the manager's lookup stream into a trace `kvtier replay` reads: one JSON line per
request, in the Mooncake format (`kvtier.trace`):

    {"timestamp": ms, "input_length": tokens, "hash_ids": [...], "block_tokens": 16,
     "found": ["primary", "primary", "nvme", "miss"], "engine_blocks": 0}

- `hash_ids`: each block key re-hashed with BLAKE2b keyed by a salt of 16 random bytes drawn
  when the file is opened (a new one for each file a rotation begins) and written nowhere, cut
  to 63 bits: equal keys in one file have equal ids, so prefixes still match, but no key and
  no prompt content leaves the engine, and ids of two files cannot be matched up.
- `timestamp`: milliseconds since the recorder started (the first file's), so a replay that
  reads arrivals sees the gaps between requests.
- `block_tokens`: the engine's tokens per block (vLLM's block size: 16 by default, where the
  shared Mooncake traces have 512); `kvtier.trace` reads it, so per-block token counts stay
  right. `input_length` is the prompt's tokens where the engine said them (less those of the
  blocks its own cache had, which no lookup names), else blocks x `block_tokens`.
- `found`: per block, where the manager's first answer found it: `primary`, a tier's name
  (promoted from it), `miss`. `engine_blocks`: leading blocks the engine's own (GPU) cache had,
  as vLLM told the connector; their keys are not in `hash_ids` (vLLM never looks them up).

Bounded: at most `QUEUE` requests (`QUEUE_BLOCKS` block keys) wait for the writer (more are
dropped and counted, never waited for); a file reaching `max_bytes` is rotated (`PATH` ->
`PATH.1` ... `PATH.<keep>`, the oldest removed); a write that fails (a read-only or removed
directory, a full disk) drops its line and is counted, and the file is opened again for the
next one. Nothing it does raises into the manager.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping
from typing import IO

from tiering.config import TraceConfig
from tiering.keys import BlockKey

__all__ = ["MISS", "PRIMARY", "QUEUE", "TrafficRecorder"]

log = logging.getLogger(__name__)

QUEUE = 4096
"""Requests waiting for the writer at most; more are dropped (`dropped`)."""
QUEUE_BLOCKS = 1 << 20
"""Block keys waiting for the writer at most (a few long prompts hold many); more: dropped."""
ANSWERS = 1 << 16
"""Keys whose first answer is remembered until their request is recorded, at most."""
PRIMARY, MISS = "primary", "miss"
"""Where a block was found, besides a tier's name."""
_SALT_BYTES = 16
_ID_MASK = (1 << 63) - 1
"""Ids below 2**63: any JSON reader keeps them exact as signed 64-bit integers."""
INTERVAL = 0.05
"""Seconds between the writer's drains of the queue."""
_CLOSE_WAIT = 5.0
"""Seconds `close` waits for the writer to write what is queued."""

Answers = list[tuple[BlockKey, str]] | Mapping[BlockKey, str | None]
"""Where a request's keys were found: the answers in order (the first of a key counts), or
each key's own (None: a miss)."""
Item = tuple[float, tuple[BlockKey, ...], Answers, int | None, int]
"""A request as queued: time, keys, its answers, prompt tokens, engine blocks."""


class TrafficRecorder:
    """Scheduler process: `record` on the scheduler's thread, the writing on a thread of its
    own (`kvtier-trace`), `close` on the shutdown's. The counts (`written`, `dropped`,
    `failed`) are plain ints, each written by one thread only."""

    def __init__(
        self,
        config: TraceConfig,
        block_tokens: int,
        *,
        queue: int = QUEUE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert config.record is not None
        self.path = config.record
        self.max_bytes = config.max_bytes
        self.keep = config.keep
        self.block_tokens = block_tokens
        self.clock = clock
        self.start = clock()
        self.written = 0
        """Requests written (the writer's)."""
        self.dropped = 0
        """Requests dropped because the queue was full (the scheduler's)."""
        self.failed = 0
        """Requests lost to a failed write (the writer's)."""
        self.answers: list[tuple[BlockKey, str]] = []
        """The manager's answers since the last request was recorded, in order (the
        scheduler's; cleared past `ANSWERS`): handed whole to the writer with the request, so
        the scheduler does one append per lookup and no work per key when recording."""
        self._limit = queue
        self._blocks_in = 0
        """Block keys queued, ever (the scheduler's)."""
        self._blocks_out = 0
        """Block keys taken off the queue, ever (the writer's)."""
        self._queue: deque[Item] = deque()
        self._wake = threading.Condition(threading.Lock())
        self._closing = False
        self._file: IO[bytes] | None = None
        self._salt = b""
        self._size = 0
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="kvtier-trace", daemon=True)
        self._thread.start()

    # -- the scheduler's thread ------------------------------------------------------------------

    def answer(self, key: BlockKey, where: str) -> None:
        """The manager found `key` at `where`. Of the answers a key gets before its request is
        recorded, the first counts (a promoted block answers PENDING, then HIT from the
        primary)."""
        answers = self.answers
        if len(answers) >= ANSWERS:  # lookups of requests never recorded
            answers.clear()
        answers.append((key, where))

    def record(
        self,
        keys: Collection[BlockKey],
        *,
        tokens: int | None = None,
        engine_blocks: int = 0,
        found: Mapping[BlockKey, str | None] | None = None,
    ) -> None:
        """A request with block keys `keys` (in prompt order) was looked up: queue it. Never
        waits; a full queue drops it (`dropped`). `found`: where each key was found, kept per
        request by the caller (handed over, not copied); None: the answers since the last
        request was recorded (`answer`)."""
        answers: Answers
        if found is None:
            answers, self.answers = self.answers, []
        else:
            answers = found
        queue = self._queue
        if (
            len(queue) >= self._limit
            or self._blocks_in - self._blocks_out + len(keys) + len(answers) > QUEUE_BLOCKS
            or self._closing
        ):
            self.dropped += 1
            return
        self._blocks_in += len(keys) + len(answers)
        queue.append((self.clock(), tuple(keys), answers, tokens, engine_blocks))
        # No wake-up: the writer drains the queue every `INTERVAL`, in one batch, rather than
        # take the GIL from the scheduler in the middle of its step for every request.

    def drop(self) -> None:
        """A request its caller could not record (it tracked too many at once): counted."""
        self.dropped += 1

    def close(self, wait: float = _CLOSE_WAIT) -> None:
        """Write what is queued (for up to `wait` seconds), then stop the writer and close the
        file. Any thread; a second call does nothing."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join(wait)

    # -- the writer's thread ---------------------------------------------------------------------

    def _run(self) -> None:
        queue = self._queue
        while True:
            with self._wake:
                if not self._closing:
                    self._wake.wait(INTERVAL)
            if not queue and self._closing:
                break
            while queue:
                item = queue.popleft()
                self._blocks_out += len(item[1]) + len(item[2])
                self._write(item)
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None

    def _line(self, item: Item) -> bytes:
        at, keys, answers, tokens, engine_blocks = item
        first: Mapping[BlockKey, str | None] = answers if isinstance(answers, Mapping) else {}
        if isinstance(answers, list):
            ordered: dict[BlockKey, str | None] = {}
            for key, where in answers:
                ordered.setdefault(key, where)
            first = ordered
        found = [first.get(key) or MISS for key in keys]
        salt, mask = self._salt, _ID_MASK
        ids = [
            int.from_bytes(hashlib.blake2b(key, digest_size=8, key=salt).digest(), "big") & mask
            for key in keys
        ]
        bt = self.block_tokens
        length = len(keys) * bt
        if tokens is not None:  # tokens past the last whole block count in no block
            length = max(0, tokens - engine_blocks * bt)
        line = {
            "timestamp": round(1000 * (at - self.start), 3),
            "input_length": length,
            "hash_ids": ids,
            "block_tokens": bt,
            "found": found,
        }
        if engine_blocks:
            line["engine_blocks"] = engine_blocks
        return json.dumps(line, separators=(",", ":")).encode() + b"\n"

    def _write(self, item: Item) -> None:
        try:
            if self._file is None:
                self._open()
            line = self._line(item)
            if self._size + len(line) > self.max_bytes and self._size:
                self._rotate()  # a new salt: hashed again
                line = self._line(item)
            assert self._file is not None
            self._file.write(line)
            self._file.flush()
        except OSError as e:
            self.failed += 1
            if not self._failing:
                log.warning("kvtier: cannot write the trace %s: %s (counted)", self.path, e)
                self._failing = True
            if self._file is not None:
                with contextlib.suppress(OSError):
                    self._file.close()
            self._file = None  # opened again, with a new salt, for the next line
            return
        self._size += len(line)
        self.written += 1
        self._failing = False

    def _open(self) -> None:
        """Open `path` for appending with a fresh salt. A file already there (an earlier run's)
        is rotated first: ids salted differently never share a file."""
        self._file = None
        self._salt = secrets.token_bytes(_SALT_BYTES)
        if os.path.exists(self.path) and os.path.getsize(self.path):
            self._shift()
        self._file = open(self.path, "ab")  # noqa: SIM115 (held open across writes)
        self._size = 0

    def _rotate(self) -> None:
        assert self._file is not None
        self._file.close()
        self._file = None
        self._open()

    def _shift(self) -> None:
        """`PATH.<n>` -> `PATH.<n+1>` from the oldest, `PATH` -> `PATH.1`; beyond `keep` removed."""
        path = self.path
        if self.keep == 0:
            os.unlink(path)
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{path}.{self.keep}")
        for n in range(self.keep - 1, 0, -1):
            with contextlib.suppress(FileNotFoundError):
                os.replace(f"{path}.{n}", f"{path}.{n + 1}")
        os.replace(path, f"{path}.1")
