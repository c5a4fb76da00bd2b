"""The model runner's part of the harness's engine: block tables, the "forward", the check.

`ModelRunner` keeps each request's block table from the scheduler's output the way vLLM's model
runner does (new requests, appended blocks, resumed requests' whole tables), and each forward:

- checks that every token the scheduler counts as computed holds, in every layer of its engine
  block, the bytes `kv.TokenContent` gives for it, whoever put them there (the engine's forward,
  its prefix cache, a load by the connector); a block that does not is a `Mismatch`;
- writes the bytes of the tokens scheduled this step;
- samples one token (from the prefix's hash) for each request whose prompt is complete.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from vllm.v1.core.sched.output import SchedulerOutput

from connectors.vllm.run import ENGINE_BLOCK, LLAMA
from tests.connectors.vllm_harness.kv import TokenContent

__all__ = ["LAYER_NAMES", "Mismatch", "ModelRunner", "RequestState"]

HEAD_DIM, KV_HEADS, LAYERS, VOCAB = LLAMA.head_dim, LLAMA.kv_heads, LLAMA.layers, LLAMA.vocab
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
TOKEN_WIDTH = KV_HEADS * 2 * HEAD_DIM
"""float32 values per token and layer: each KV head's key and value."""


@dataclass
class RequestState:
    """The harness's view of one request, as a model runner keeps it. Harness thread."""

    content: TokenContent
    prompt_len: int
    block_ids: list[int] = field(default_factory=list)
    first_computed: int | None = None
    """`num_computed_tokens` when the scheduler first ran it: the engine's prefix cache hit
    plus what the connector loaded."""


@dataclass
class Mismatch:
    """An engine block holding other bytes than its tokens' when the forward read it."""

    request: str
    step: int
    block_index: int
    engine_block: int


class ModelRunner:
    """The harness's stand-in for vLLM's model runner over the engine's KV cache tensors
    (`(block, KV head, token, key|value)` per layer). Harness thread."""

    def __init__(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        self.requests: dict[str, RequestState] = {}
        self.mismatches: list[Mismatch] = []
        self.checked_blocks = 0
        self.resumed = 0
        """Times a preempted request was scheduled again."""
        self.step = 0

    def add(self, name: str, prompt: list[int]) -> None:
        content = TokenContent(LAYERS, TOKEN_WIDTH)
        content.extend(prompt)
        self.requests[name] = RequestState(content, len(prompt))

    def forward(self, out: SchedulerOutput, step: int) -> tuple[list[str], list[list[int]]]:
        """The block tables as the model runner keeps them from the scheduler's output; the
        check of every computed token; this step's tokens written; one token sampled for each
        request whose prompt is complete."""
        self.step = step
        computed: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            state = self.requests[new.req_id]
            if state.first_computed is not None:  # vLLM 0.34 re-sends a resumed request
                self.resumed += 1
            state.block_ids = list(new.block_ids[0])
            computed[new.req_id] = new.num_computed_tokens
            if state.first_computed is None:
                state.first_computed = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        # A resumed request's whole table (vLLM 0.34 re-sends it as a new request instead).
        resumed = getattr(cached, "resumed_req_ids", ())
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            new_ids = cached.new_block_ids[i]
            if req_id in resumed:
                self.resumed += 1
                assert new_ids is not None
                state.block_ids = list(new_ids[0])
            elif new_ids is not None:
                state.block_ids += new_ids[0]
            computed[req_id] = cached.num_computed_tokens[i]
        req_ids, sampled = [], []
        for req_id, count in out.num_scheduled_tokens.items():
            state = self.requests[req_id]
            start = computed[req_id]
            self._check(req_id, state, start)
            self._write(state, start, start + count)
            req_ids.append(req_id)
            if start + count >= len(state.content.tokens):
                token = 3 + state.content.prefix_hash(start + count - 1) % (VOCAB - 3)
                state.content.extend([token])
                sampled.append([token])
            else:
                sampled.append([])
        return req_ids, sampled

    def _slots(self, state: RequestState, start: int, end: int) -> Iterator[tuple[int, int, int]]:
        """(block index, engine block, first position) of each block covering `start..end`."""
        for index in range(start // ENGINE_BLOCK, -(-end // ENGINE_BLOCK)):
            yield index, state.block_ids[index], index * ENGINE_BLOCK

    def _write(self, state: RequestState, start: int, end: int) -> None:
        values = state.content.values(start, end)
        for _, block, first in self._slots(state, start, end):
            lo, hi = max(start, first), min(end, first + ENGINE_BLOCK)
            rows = values[lo - start : hi - start]  # (tokens, layers, width)
            for layer, name in enumerate(LAYER_NAMES):
                tokens = rows[:, layer].reshape(hi - lo, KV_HEADS, 2 * HEAD_DIM)
                self.kv_caches[name][block, :, lo - first : hi - first] = tokens.transpose(0, 1)

    def _check(self, req_id: str, state: RequestState, end: int) -> None:
        """Every token before `end` holds its own bytes, in every layer of its engine block."""
        values = state.content.values(0, end)
        for index, block, first in self._slots(state, 0, end):
            hi = min(end, first + ENGINE_BLOCK)
            held = torch.stack(
                [
                    self.kv_caches[name][block, :, : hi - first].transpose(0, 1)
                    for name in LAYER_NAMES
                ],
                dim=1,
            ).reshape(hi - first, LAYERS, TOKEN_WIDTH)
            self.checked_blocks += 1
            if not torch.equal(held.view(torch.int32), values[first:hi].view(torch.int32)):
                self.mismatches.append(Mismatch(req_id, self.step, index, block))
