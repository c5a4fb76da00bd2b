"""`kvtier demo`: a real vLLM engine with kvtier on a short multi-turn chat workload.

Several conversations share a system prompt and take turns; the engine's own KV cache holds
only a few conversations, so a conversation's earlier turns are evicted from it by the others
and come back from kvtier instead of being recomputed. Then a second engine process starts on
the same file tier (a warm restart) and replays the conversations: their turns come from disk.
Runs on a CPU (vLLM's CPU build, in its own virtual environment, prepared on first use) with an
8-layer Llama of random weights written locally, large enough that recomputing a conversation
costs real time; no external server is needed. Each request's time to first token is vLLM's own
measure; each engine is warmed up first by a request left out of the figures.
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from kvtier.scenario import run_scenario
from kvtier.venv import ensure_vllm_venv

__all__ = [
    "DEFAULT_CONFIG",
    "MAX_TURNS",
    "MODEL",
    "DemoResult",
    "chat_workload",
    "default_config",
    "engine_blocks",
    "run_demo",
]


def default_config() -> Path:
    """The demo's config, package data of kvtier (so an installed kvtier finds it too; the
    example configs/demo.yaml of a checkout is the same file, a test checks)."""
    # kvtier is installed as files (never zipped: it ships a compiled helper), so the resource
    # is a real path that vLLM's process can open by name.
    return Path(str(resources.files("kvtier") / "configs" / "demo.yaml"))


DEFAULT_CONFIG = default_config()

MODEL = {
    "kind": "llama",
    "hidden": 1024,
    "heads": 16,
    "kv_heads": 8,
    "head_dim": 64,
    "layers": 8,
    "intermediate": 2816,
}
"""The demo's model (`connectors.vllm.run.Shape`): an 8-layer Llama of ~100M parameters, large
enough that recomputing a returning conversation costs a CPU real time (seconds), small enough
that three engines run the demo in a few minutes."""
KV_BYTES_PER_TOKEN = 8 * 2 * 8 * 64 * 4  # layers x (K, V) x KV heads x head size x fp32: 32 KiB
BLOCK_TOKENS = 32  # connectors.vllm.run.ENGINE_BLOCK
MAX_POSITIONS = 4096  # the model's max_position_embeddings (connectors.vllm.run.model_config)
SYSTEM_TOKENS = 256
FIRST_MESSAGE_TOKENS = 512
MESSAGE_TOKENS = 60
ANSWER_TOKENS = 4
"""Tokens each turn generates (the answer, part of the next turn's prompt)."""
WARMUP = [5, 6, 7, 8, 9, 10, 11, 12]
"""Each engine's warm-up request, left out of the figures: a fresh engine's first request pays
one-time costs (seconds). Shorter than a block, so nothing of it is cached or stored."""
MAX_TURNS = (MAX_POSITIONS - SYSTEM_TOKENS - FIRST_MESSAGE_TOKENS - ANSWER_TOKENS) // (
    ANSWER_TOKENS + MESSAGE_TOKENS
) + 1
"""The most turns whose last prompt and answer fit the model's positions."""


def chat_workload(conversations: int, turns: int, seed: int = 0) -> list[list[list[int]]]:
    """User messages (token ids) per conversation and turn, after a shared system prompt."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 1000) for _ in range(n)]

    system = tokens(SYSTEM_TOKENS)
    return [
        [system + tokens(FIRST_MESSAGE_TOKENS)] + [tokens(MESSAGE_TOKENS) for _ in range(turns - 1)]
        for _ in range(conversations)
    ]


def engine_blocks(turns: int) -> int:
    """The engine's own KV cache, in blocks: room for the longest turn (its prompt and answer)
    and little more, so a conversation is evicted from it while the others take their turns."""
    longest = SYSTEM_TOKENS + FIRST_MESSAGE_TOKENS + (turns - 1) * (ANSWER_TOKENS + MESSAGE_TOKENS)
    return -(-(longest + ANSWER_TOKENS) // BLOCK_TOKENS) + 2  # vLLM keeps one block spare


@dataclass(frozen=True)
class DemoResult:
    requests: int
    prompt_tokens: int
    engine_cached_tokens: int
    kvtier_tokens: int
    recomputed_tokens: int
    bytes_loaded: int
    bytes_stored: int
    tier_blocks: int
    """Blocks promoted from the secondary tiers (the file tier, in the demo's config)."""
    copy_seconds: float
    """Time the workers spent copying blocks between the engine and kvtier (loads + stores)."""
    seconds: float
    """Time the engine took for the whole workload."""
    ttft: list[list[float]]
    """Time to first token of each request, in seconds, by turn then conversation (vLLM's own
    request metrics: from the request's arrival to the end of the step that sampled its first
    token)."""
    outputs: list[list[int]]

    @classmethod
    def of(cls, result: dict[str, Any], conversations: int) -> DemoResult:
        outputs = result["outputs"]  # turn by turn, each turn's conversations in order
        metrics = result["metrics"]
        prompt = sum(o["prompt_tokens"] for o in outputs)
        cached = sum(o["cached_tokens"] for o in outputs)
        ttft = [float(o["ttft"]) for o in outputs]
        return cls(
            requests=len(outputs),
            prompt_tokens=prompt,
            engine_cached_tokens=int(metrics["engine_cached_tokens"]),
            kvtier_tokens=int(metrics["kvtier_cached_tokens"]),
            recomputed_tokens=prompt - cached,
            bytes_loaded=int(metrics["load_bytes"]),
            bytes_stored=int(metrics["store_bytes"]),
            tier_blocks=int(metrics["tier_promotions"]),
            copy_seconds=float(metrics["load_seconds"] + metrics["store_seconds"]),
            seconds=float(result["seconds"]),
            ttft=[ttft[i : i + conversations] for i in range(0, len(ttft), conversations)],
            outputs=[o["tokens"] for o in outputs],
        )

    def mean_ttft(self, turn: int) -> float:
        """The mean time to first token of turn `turn` (0 the first) over the conversations."""
        return statistics.fmean(self.ttft[turn])


def run_demo(
    config: Path,
    conversations: int = 4,
    turns: int = 4,
    compare: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict[str, DemoResult]:
    """Run the workload (with `compare`, first without kvtier), then with kvtier, then again
    in a fresh engine on the same tiers (a warm restart); results by name. `progress` is told
    what the engines are doing (`engine 2/3 (kvtier): request 5/16`)."""
    python = ensure_vllm_venv()
    extra = {
        "spec_name": "TieredOffloadingSpec",
        "spec_module_path": "connectors.vllm",
        "config": str(config.resolve()),
    }
    runs: dict[str, dict[str, Any] | None] = {"vLLM alone": None} if compare else {}
    runs |= {"kvtier": extra, "warm restart": extra}
    blocks = engine_blocks(turns)
    results = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as tmp:
        workdir = Path(tmp)
        os.environ.setdefault("KVTIER_DEMO_DIR", str(workdir / "nvme"))
        for number, (name, spec) in enumerate(runs.items(), 1):
            scenario = {
                "model_dir": str(workdir / "model"),
                "model": MODEL,
                "engine_blocks": blocks,
                "max_model_len": (blocks - 1) * BLOCK_TOKENS,  # vLLM keeps one block spare
                "max_tokens": ANSWER_TOKENS,
                "warmup": WARMUP,
                "conversations": chat_workload(conversations, turns),
                "extra": spec,
            }
            engine = f"engine {number}/{len(runs)} ({name})"
            tell = None if progress is None else _prefixed(progress, engine)
            result = run_scenario(python, scenario, workdir, progress=tell)
            results[name] = DemoResult.of(result, conversations)
    return results


def _prefixed(progress: Callable[[str], None], prefix: str) -> Callable[[str], None]:
    return lambda status: progress(f"{prefix}: {status}")
