"""`RequestTraffic`: vLLM's lookups and stores grouped by request, each request recorded once
(`trace.record`, `tiering.manager.traffic`). Scheduler process, scheduler thread.

vLLM names the request in every call (`req_context.req_id`) and the tiering manager does not,
so the grouping lives here: per request, its block keys in the prompt's order (those looked up,
from the first block the engine's own cache lacks, then those offered to `prepare_store` past
them), each with where its first lookup found it (`TieringOffloadingManager.lookup_where`), kept
with the request rather than in one stream, so a deferred request's lookups, which fall between
other requests' calls, are attributed to it. At `on_request_finished` the request is handed to
the manager's `record` whole (the writer thread turns it into a line).

The engine's own cache: vLLM looks up from the first block it lacks, and stores from the first
block of the prompt unless a load covered the prefix; the blocks a first store offers before the
first block looked up are the engine cache's (`engine_blocks`, not in the keys). The prompt's
tokens and the engine cache's tokens are what vLLM 0.34 puts in `ReqContext`
(`num_prompt_tokens`) or, before it, what its scheduler's lookup holds (`req_status`), read once
per request from the caller's frame (`caller_local`), never on a request not recorded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from connectors.vllm.caller import caller_local
from tiering.keys import BlockKey
from tiering.manager import TieringOffloadingManager

__all__ = ["MAX_REQUESTS", "RequestTraffic"]

MAX_REQUESTS = 4096
"""Requests tracked at once at most; beyond it the oldest is dropped and counted
(`trace_dropped`): a request vLLM never ends cannot grow the map."""


class _Request:
    """One request's blocks as seen so far (`RequestTraffic`)."""

    __slots__ = ("blocks", "engine_blocks", "stored", "tokens")

    def __init__(self, tokens: int | None, engine_blocks: int | None) -> None:
        self.blocks: dict[BlockKey, str | None] = {}
        """Its keys in prompt order -> where the first lookup found it (None: only stored)."""
        self.tokens = tokens
        self.engine_blocks = engine_blocks
        """Leading blocks the engine's cache had (None: not known; the first store tells)."""
        self.stored = False
        """A store was offered (the engine cache's blocks are passed over in the first only)."""


class RequestTraffic:
    """Scheduler process, scheduler thread: `KvtierManager` calls it only when the manager
    records (`manager.traffic` set), so without `trace.record` nothing here runs."""

    def __init__(self, manager: TieringOffloadingManager, limit: int = MAX_REQUESTS) -> None:
        assert manager.traffic is not None
        self.manager = manager
        self.traffic = manager.traffic
        self.limit = limit
        self.requests: dict[str, _Request] = {}

    def looked_up(self, req_context: Any, key: BlockKey, where: str | None) -> None:
        """vLLM looked `key` up for the request; the manager found it at `where` (None: RETRY,
        no answer yet: a later scan's counts)."""
        request = self.requests.get(req_context.req_id)
        if request is None:
            request = self._begin(req_context, lookup=True)
        blocks = request.blocks
        if blocks.get(key) is None:
            blocks[key] = where

    def offered(self, req_context: Any, keys: Sequence[BlockKey]) -> None:
        """vLLM offered `keys` (in prompt order) to `prepare_store` for the request."""
        request = self.requests.get(req_context.req_id)
        if request is None:
            request = self._begin(req_context, lookup=False)
        blocks = request.blocks
        if not request.stored:
            request.stored = True
            skip = _engine_prefix(request, keys)
            if request.engine_blocks is None:
                request.engine_blocks = skip
            keys = keys[skip:]
        for key in keys:
            if key not in blocks:
                blocks[key] = None

    def finished(self, req_context: Any) -> None:
        """vLLM ended the request: recorded, once."""
        request = self.requests.pop(req_context.req_id, None)
        if request is not None:
            self._record(request)

    def _record(self, request: _Request) -> None:
        if not request.blocks:
            return
        self.manager.record(
            request.blocks.keys(),
            tokens=request.tokens,
            engine_blocks=request.engine_blocks or 0,
            found=request.blocks,
        )

    def flush(self) -> None:
        """The engine shuts down: every request still tracked is recorded as far as it was seen
        (vLLM ends a request in the step after its last, which the last request of a run that
        stops then never gets)."""
        for request in list(self.requests):
            self._record(self.requests.pop(request))

    def _begin(self, req_context: Any, *, lookup: bool) -> _Request:
        requests = self.requests
        if len(requests) >= self.limit:
            del requests[next(iter(requests))]
            self.traffic.drop()
        tokens = getattr(req_context, "num_prompt_tokens", None)
        computed: int | None = None
        if lookup:  # vLLM's scheduler is looking the request up: its state is in a caller
            state = caller_local(
                "req_status",
                lambda v: hasattr(v, "num_locally_computed_tokens"),
                above=2,
                depth=8,
            )
            if state is not None:
                computed = state.num_locally_computed_tokens
                if tokens is None:
                    tokens = getattr(getattr(state, "req", None), "num_prompt_tokens", None)
        engine = None if computed is None else computed // self.traffic.block_tokens
        request = requests[req_context.req_id] = _Request(tokens, engine)
        return request


def _engine_prefix(request: _Request, keys: Sequence[BlockKey]) -> int:
    """How many of a request's first stored `keys` are the engine cache's blocks: none when the
    stores begin at a block looked up (past a load); else the engine's count where known, or
    those before the first block looked up (vLLM looks nothing up for a prompt its cache holds
    whole)."""
    blocks = request.blocks
    if not keys or keys[0] in blocks:
        return 0
    if request.engine_blocks is not None:
        return min(request.engine_blocks, len(keys))
    if blocks:
        first = next(iter(blocks))
        for index, key in enumerate(keys):
            if key == first:
                return index
    return 0
