"""kvtier inside a real vLLM 0.32 CPU engine for the model shapes users run: a GQA Qwen3 (8
query heads over 2 KV heads, head_dim 64, q_norm/k_norm), a Gemma3 mixing sliding-window and
full-attention layers (vLLM's hybrid KV-cache manager gives it several KV-cache groups), and the
Qwen3 with `tensor_parallel_size=2` (two worker processes, each holding one KV head).

Each shape runs the scenario of shared/vllm-cpu-e2e.md three times, one engine at a time:

1. vLLM alone: the baseline, whose tokens and logprobs every other run must reproduce;
2. with kvtier (a large primary, a write-through file tier): an unrelated request evicts a
   shared prefix from the engine's own cache, and the request that comes back to it must get
   the prefix from kvtier (vLLM's cached-token count, its count of tokens by source, the
   bytes its workers report loaded), and every process must log the same kvtier namespace;
3. a fresh engine on the same file tier: its first request finds the prefix on disk (kvtier's
   promotion counter, then the same three figures).

A sliding-window layer keeps (and so offloads) only the blocks a later hit can use: the window
before each block boundary its prompt can end a hit at; the last prompt token is always
recomputed. A prefix shared with a different continuation is no such boundary, so the Gemma3
scenario is a chat: a conversation's next turn extends the whole earlier conversation.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvtier.scenario import run_scenario
from kvtier.venv import ensure_vllm_venv
from tests.helpers.vllm_runs import namespaces

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PREFIX = 320
BLOCK = 32  # tokens per engine block and per kvtier block

QWEN3 = {"kind": "qwen3", "hidden": 256, "heads": 8, "kv_heads": 2, "head_dim": 64}
QWEN3 |= {"intermediate": 512}
GEMMA3 = {"kind": "gemma3", "kv_heads": 2, "head_dim": 32, "layers": 6, "sliding_window": 64}
GEMMA3 |= {"layer_types": ["sliding", "sliding", "full", "sliding", "sliding", "full"]}
"""Gemma3's pattern, shortened: 4 sliding-window layers and 2 full ones make 3 KV-cache groups
(2 sliding, 1 full) of 2 layers each, sharing 2 KV-cache tensors."""


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(n)]


RNG = random.Random(0)
SHARED = tokens(RNG, PREFIX)
FIRST, UNRELATED, AGAIN, LATER = (
    SHARED + tokens(RNG, 40),
    tokens(RNG, 480),
    SHARED + tokens(RNG, 40),
    SHARED + tokens(RNG, 40),
)
TURN_2, TURN_3 = tokens(RNG, 40), tokens(RNG, 40)


def prompts_scenario(restart_prompt: bool) -> dict[str, Any]:
    """A shared prefix, an unrelated request that evicts it, the prefix again with another
    continuation (output 2); for the baseline also with a third (output 3: the restarted
    engine's prompt, which the first engine with kvtier must not have stored itself)."""
    return {"prompts": [FIRST, UNRELATED, AGAIN, *([LATER] if restart_prompt else [])]}


def chat_scenario(restart_prompt: bool) -> dict[str, Any]:
    """Conversation A opens with the shared text; conversation B, unrelated, evicts it; A's
    second turn (output 2); for the baseline also its third (output 3: the restarted engine's
    prompt)."""
    return {"conversations": [[SHARED, TURN_2, *([TURN_3] if restart_prompt else [])], [UNRELATED]]}


def later_prompt(baseline: dict[str, Any]) -> list[int]:
    return LATER


def third_turn(baseline: dict[str, Any]) -> list[int]:
    """Conversation A's third turn: its history, as the baseline answered it."""
    first: list[int] = baseline["outputs"][0]["tokens"]
    second: list[int] = baseline["outputs"][2]["tokens"]
    return SHARED + first + TURN_2 + second + TURN_3


@dataclass(frozen=True)
class ShapeCase:
    """One model shape and what kvtier must give it.

    `block_bytes`: one kvtier block over all workers (one KV-cache group's layers).
    `hit`: the tokens vLLM finds cached for output 2 with kvtier; `loaded`: the blocks the
    worker copies for it. `restart_hit` / `restart_blocks`: the same for the restarted engine,
    whose blocks all come from the file tier.
    """

    name: str
    model: dict[str, Any]
    engine_blocks: int
    block_bytes: int
    scenario: Callable[[bool], dict[str, Any]]
    hit: int
    loaded: int
    restart_prompt: Callable[[dict[str, Any]], list[int]]
    restart_hit: int
    restart_blocks: int
    num_layers: int = 2
    tensor_parallel_size: int = 1


def cpu_binding(ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `ranks` workers: one CPU each, the first this process may
    use. vLLM's automatic binding wants a NUMA node per rank ("Not enough allowed NUMA nodes
    to bind threads of 2 local CPUWorkers") and these machines have one."""
    cpus = sorted(os.sched_getaffinity(0))
    assert len(cpus) >= ranks, f"{ranks} ranks need as many CPUs; this process has {cpus}"
    return "|".join(str(cpu) for cpu in cpus[:ranks])


SHAPES = [
    # 9 prefix blocks were evicted (the engine kept the first); the restarted engine, whose
    # cache is empty, loads all 10.
    ShapeCase(
        name="qwen3-gqa",
        model=QWEN3,
        engine_blocks=18,
        block_bytes=BLOCK * 2 * 2 * 2 * 64 * 4,  # tokens x layers x (K, V) x KV heads x head x fp32
        scenario=prompts_scenario,
        hit=PREFIX,
        loaded=PREFIX // BLOCK - 1,
        restart_prompt=later_prompt,
        restart_hit=PREFIX,
        restart_blocks=PREFIX // BLOCK,
    ),
    # Turn 2 (368 tokens) can end a hit where turn 1's prompt could (320 - 1, rounded down to
    # a block: 288): 9 blocks of the full-attention group and, of each sliding group, the 2
    # blocks of the 64-token window before it. Turn 3 (416 tokens) ends one at 352, where
    # turn 2 left its windows: 11 + 2 x 2 blocks.
    ShapeCase(
        name="gemma3-sliding-and-full",
        model=GEMMA3,
        engine_blocks=54,  # shared by the 3 groups: 18 blocks of 32 tokens each
        block_bytes=BLOCK * 2 * 2 * 2 * 32 * 4,  # a group's 2 layers
        scenario=chat_scenario,
        hit=288,
        loaded=9 + 2 * 2,
        restart_prompt=third_turn,
        restart_hit=352,
        restart_blocks=11 + 2 * 2,
        num_layers=6,
    ),
    ShapeCase(
        name="qwen3-tp2",
        model=QWEN3,
        engine_blocks=18,
        block_bytes=BLOCK * 2 * 2 * 2 * 64 * 4,  # each rank's half: one KV head
        scenario=prompts_scenario,
        hit=PREFIX,
        loaded=PREFIX // BLOCK - 1,
        restart_prompt=later_prompt,
        restart_hit=PREFIX,
        restart_blocks=PREFIX // BLOCK,
        tensor_parallel_size=2,
    ),
]


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    return ensure_vllm_venv()


def run(python: Path, workdir: Path, shape: ShapeCase, extra: Any, **body: Any) -> dict[str, Any]:
    ranks = shape.tensor_parallel_size
    scenario = {
        "model_dir": str(workdir / "model"),
        "model": shape.model,
        "engine_blocks": shape.engine_blocks,
        "tensor_parallel_size": ranks,
        "env": {"VLLM_CPU_OMP_THREADS_BIND": cpu_binding(ranks)} if ranks > 1 else {},
        "extra": extra,
        **body,
    }
    return run_scenario(python, scenario, workdir)


def kvtier_extra(workdir: Path) -> dict[str, Any]:
    """A primary that holds every block of the scenario, over a write-through file tier."""
    tier = {"name": "nvme", "type": "file", "path": str(workdir / "nvme"), "min_free": 0}
    return {
        "spec_name": "TieredOffloadingSpec",
        "spec_module_path": "connectors.vllm",
        "kvtier": {
            "primary": {"capacity": "8MiB", "eviction": "lru", "directory": str(workdir)},
            "tiers": [{**tier, "write": "through"}],
            "promotion": {"gate": "always", "deadline": "5s"},
        },
    }


@dataclass
class Runs:
    shape: ShapeCase
    workdir: Path
    baseline: dict[str, Any]
    offloaded: dict[str, Any]


@pytest.fixture(scope="module", params=SHAPES, ids=[s.name for s in SHAPES])
def runs(
    request: pytest.FixtureRequest, vllm_python: Path, tmp_path_factory: pytest.TempPathFactory
) -> Runs:
    """The baseline and the run with kvtier of one shape, shared by its tests."""
    shape: ShapeCase = request.param
    workdir = tmp_path_factory.mktemp(shape.name)
    baseline = run(vllm_python, workdir, shape, None, **shape.scenario(True))
    offloaded = run(vllm_python, workdir, shape, kvtier_extra(workdir), **shape.scenario(False))
    return Runs(shape, workdir, baseline, offloaded)


def same_outputs(ours: dict[str, Any], theirs: dict[str, Any]) -> bool:
    return (ours["tokens"], ours["logprobs"]) == (theirs["tokens"], theirs["logprobs"])


def test_outputs_equal_vllm_alone_and_the_evicted_prefix_comes_from_kvtier(runs: Runs) -> None:
    shape, baseline, result = runs.shape, runs.baseline, runs.offloaded
    assert len(result["outputs"]) == 3 and len(baseline["outputs"]) == 4
    for ours, theirs in zip(result["outputs"], baseline["outputs"][:3], strict=True):
        assert same_outputs(ours, theirs)
    engine_kept = baseline["outputs"][2]["cached_tokens"]
    assert engine_kept < shape.hit - BLOCK  # vLLM alone had lost the prefix
    assert result["outputs"][2]["cached_tokens"] == shape.hit
    metrics = result["metrics"]
    assert metrics["kvtier_cached_tokens"] == shape.hit - engine_kept
    # What the workers copied back (vLLM's counter of the bytes they report), block by block.
    assert metrics["load_bytes"] == shape.loaded * shape.block_bytes
    assert metrics["store_bytes"] > 0
    assert not list(runs.workdir.glob("kvtier-*.region"))  # removed at shutdown


def test_scheduler_and_every_rank_agree_on_the_namespace(runs: Runs) -> None:
    """The scheduler stores objects under its namespace; each worker rank computes its own
    from what vLLM hands it: they must be one, and name the shape."""
    shape = runs.shape
    found = namespaces(runs.offloaded)
    ranks = {f"worker rank {r}" for r in range(shape.tensor_parallel_size)}
    assert set(found) == {"scheduler", *ranks}
    assert len({digest for digest, _ in found.values()}) == 1
    (_, layout), *_ = found.values()
    assert layout["num_layers"] == shape.num_layers
    assert layout["num_kv_heads"] == shape.model["kv_heads"]
    assert layout["head_size"] == shape.model["head_dim"]
    assert layout["tp_size"] == shape.tensor_parallel_size
    assert layout["page_size_bytes"] == shape.block_bytes // shape.tensor_parallel_size


def test_a_restarted_engine_finds_the_prefix_on_disk(runs: Runs, vllm_python: Path) -> None:
    """A fresh engine on the same file tier: nothing in its own cache, the prefix comes from
    the blocks the first engine wrote through to disk, promoted and loaded on its first
    request."""
    shape, baseline = runs.shape, runs.baseline
    assert list((runs.workdir / "nvme").rglob("*.kv"))
    prompt = shape.restart_prompt(baseline)
    result = run(vllm_python, runs.workdir, shape, kvtier_extra(runs.workdir), prompts=[prompt])
    (out,) = result["outputs"]
    assert same_outputs(out, baseline["outputs"][3])
    assert out["cached_tokens"] == shape.restart_hit
    metrics = result["metrics"]
    assert metrics["kvtier_cached_tokens"] == shape.restart_hit
    assert metrics["tier_promotions"] == shape.restart_blocks
    assert metrics["load_bytes"] == shape.restart_blocks * shape.block_bytes
