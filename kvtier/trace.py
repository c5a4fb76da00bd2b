"""Request traces: the Mooncake JSONL format, read with bounded memory, and the block keys of
each request.

One JSON object per line: `input_length` (tokens) and `hash_ids` (prefix block ids,
`BLOCK_TOKENS` tokens per block; equal ids mean a reusable prefix), optionally `timestamp` (the
arrival, milliseconds since the trace's start: a fleet replay admits requests that arrive
together in the same step), plus `output_length`, which no replay needs. A trace kvtier
recorded (`trace.record`, `tiering.manager.traffic`) gives `block_tokens` on every line, the
engine's tokens per block (vLLM's block size), which then replace `BLOCK_TOKENS` in the tokens
each block carries; its other fields (`found`, `engine_blocks`) no replay reads. `kvtier.replay` and
`kvtier.fleet` replay them; bench/ reads them for its workloads.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tiering.errors import TraceError
from tiering.keys import BlockKey, make_key

__all__ = [
    "BLOCK_TOKENS",
    "MAX_BLOCK_TOKENS",
    "MAX_TIMESTAMP_MS",
    "MAX_TRACE_BYTES",
    "REFERENCE_HIT_RATES",
    "Trace",
    "TraceRequest",
    "load_trace",
    "trace_keys",
]

MAX_TRACE_BYTES = 1 << 30
"""The largest trace read (uncompressed): the shipped one is 3 MiB."""
BLOCK_TOKENS = 512
"""Tokens per `hash_ids` entry in the Mooncake traces."""
MAX_BLOCK_TOKENS = 1 << 20
"""The most tokens per block a line may give (`block_tokens`)."""
MAX_TIMESTAMP_MS = 10**15
"""The latest arrival a trace line may give (about 30,000 years: a bound, so that a crafted
number is an error rather than an infinity or a float that no longer tells milliseconds apart)."""

REFERENCE_HIT_RATES: dict[str, dict[str, dict[int, float]]] = {
    # The Mooncake FAST'25 conversation trace (bench/traces/README.md, "Reference figures"),
    # keyed by the SHA-256 of its uncompressed JSONL. Printed beside measured figures so a
    # reader sees at once whether a replay reproduces them; never used as a result.
    "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df": {
        "lru": {1638: 5.2, 3276: 7.3, 6553: 15.2, 13107: 25.0, 26214: 32.9},
        "arc": {1638: 6.5, 3276: 8.4, 6553: 17.7, 13107: 27.5, 26214: 31.9},
    },
}
"""Published prefix hit rates (percent) of known traces: trace digest -> policy -> capacity."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: its prefix block ids and its prompt length in tokens."""

    hash_ids: tuple[int, ...]
    input_length: int
    timestamp: float | None = None
    """Arrival in seconds since the trace's start (the line's milliseconds / 1000); None when
    the line has none."""
    tokens_per_block: int = BLOCK_TOKENS
    """Tokens per `hash_ids` entry: the line's `block_tokens` (a recorded trace), else 512."""

    def block_tokens(self) -> list[int]:
        """Tokens carried by each block: `min(b, input_length - b*i)`, at least 1, where b is
        `tokens_per_block`."""
        n, b = self.input_length, self.tokens_per_block
        return [max(1, min(b, n - b * i)) for i in range(len(self.hash_ids))]


@dataclass(frozen=True, slots=True)
class Trace:
    """A loaded trace: its requests, where it came from, and the digest of its text."""

    path: Path
    requests: tuple[TraceRequest, ...]
    sha256: str
    """SHA-256 of the uncompressed JSONL, which identifies a trace whatever its file name."""

    def reference_hit_rate(self, policy: str, capacity: int) -> float | None:
        """The published hit rate (percent) for this trace, policy and capacity, if known."""
        return REFERENCE_HIT_RATES.get(self.sha256, {}).get(policy, {}).get(capacity)


def load_trace(path: str | Path) -> Trace:
    """Read a JSONL trace (optionally gzip-compressed); a malformed line raises `TraceError`
    naming the file and the line number."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TRACE_BYTES + 1)  # a device (/dev/zero) has no end
    except OSError as e:
        raise TraceError(f"{path}: cannot read trace: {e.strerror or e}") from e
    if raw[:2] == b"\x1f\x8b":
        try:
            with gzip.GzipFile(fileobj=io.BytesIO(raw)) as unpacked:
                raw = unpacked.read(MAX_TRACE_BYTES + 1)  # a gzip bomb stops here
        except (OSError, EOFError) as e:
            raise TraceError(f"{path}: not a readable gzip file: {e}") from e
    if len(raw) > MAX_TRACE_BYTES:
        raise TraceError(f"{path}: larger than {MAX_TRACE_BYTES >> 20} MiB (uncompressed)")
    requests = []
    for lineno, line in enumerate(io.StringIO(raw.decode("utf-8", errors="replace")), 1):
        if line.strip():
            requests.append(_parse_line(line, path, lineno))
    if not requests:
        raise TraceError(f"{path}: the trace has no requests")
    return Trace(path, tuple(requests), hashlib.sha256(raw).hexdigest())


def _parse_line(line: str, path: Path, lineno: int) -> TraceRequest:
    where = f"{path}:{lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not valid JSON: {e.msg} at column {e.colno}") from None
    except (ValueError, RecursionError) as e:  # an integer of thousands of digits; deep nesting
        raise TraceError(f"{where}: not a trace line: {str(e)[:80]}") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for name in ("input_length", "hash_ids"):
        if name not in obj:
            raise TraceError(f"{where}: missing field {name!r}")
    length = obj["input_length"]
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise TraceError(
            f"{where}: input_length must be a non-negative integer, got {repr(length)[:40]}"
        )
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1 << 64 for i in ids
    ):
        raise TraceError(f"{where}: hash_ids must be a list of non-negative integers below 2**64")
    stamp = obj.get("timestamp")
    if stamp is not None and (
        isinstance(stamp, bool)
        or not isinstance(stamp, int | float)
        or not 0 <= stamp <= MAX_TIMESTAMP_MS
    ):
        raise TraceError(
            f"{where}: timestamp must be milliseconds from 0 to {MAX_TIMESTAMP_MS:,}, "
            f"got {repr(stamp)[:40]}"
        )
    per_block = obj.get("block_tokens", BLOCK_TOKENS)
    if (
        isinstance(per_block, bool)
        or not isinstance(per_block, int)
        or not 1 <= per_block <= MAX_BLOCK_TOKENS
    ):
        raise TraceError(
            f"{where}: block_tokens must be an integer from 1 to {MAX_BLOCK_TOKENS:,}, "
            f"got {repr(per_block)[:40]}"
        )
    return TraceRequest(tuple(ids), length, None if stamp is None else stamp / 1000, per_block)


def trace_keys(requests: Sequence[TraceRequest]) -> list[list[BlockKey]]:
    """The block keys of each request, shaped like vLLM's: a 32-byte SHA-256 per distinct hash
    id (of its 8 bytes: `load_trace` takes ids below 2**64; vLLM's default block hash is 32
    bytes), KV group 0."""
    cache: dict[int, BlockKey] = {}
    out = []
    for request in requests:
        keys = []
        for block_id in request.hash_ids:
            key = cache.get(block_id)
            if key is None:
                digest = hashlib.sha256(block_id.to_bytes(8, "big")).digest()
                key = cache[block_id] = make_key(digest)
            keys.append(key)
        out.append(keys)
    return out
