"""`kvtier demo`: a real vLLM engine with kvtier on a short multi-turn chat workload.

Several conversations share a system prompt and take turns; the engine's own KV cache holds
only a few conversations, so a conversation's earlier turns are evicted from it by the others
and come back from kvtier instead of being recomputed. Then a second engine process starts on
the same file tier (a warm restart) and replays the conversations: their turns come from disk.
Runs on a CPU (vLLM's CPU build, in its own virtual environment, prepared on first use) with a
tiny Llama of random weights written locally; no external server is needed.
"""

from __future__ import annotations

import os
import random
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from kvtier.scenario import run_scenario
from kvtier.venv import ensure_vllm_venv

__all__ = ["DEFAULT_CONFIG", "DemoResult", "chat_workload", "default_config", "run_demo"]


def default_config() -> Path:
    """The demo's config, package data of kvtier (so an installed kvtier finds it too; the
    example configs/demo.yaml of a checkout is the same file, a test checks)."""
    # kvtier is installed as files (never zipped: it ships a compiled helper), so the resource
    # is a real path that vLLM's process can open by name.
    return Path(str(resources.files("kvtier") / "configs" / "demo.yaml"))


DEFAULT_CONFIG = default_config()

ENGINE_BLOCKS = 24  # 768 tokens of engine KV cache: about one and a half conversations


def chat_workload(conversations: int, turns: int, seed: int = 0) -> list[list[list[int]]]:
    """User messages (token ids) per conversation and turn, after a shared system prompt."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 1000) for _ in range(n)]

    system = tokens(128)
    return [
        [system + tokens(96)] + [tokens(48) for _ in range(turns - 1)] for _ in range(conversations)
    ]


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
    outputs: list[list[int]]

    @classmethod
    def of(cls, result: dict[str, Any]) -> DemoResult:
        outputs = result["outputs"]
        metrics = result["metrics"]
        prompt = sum(o["prompt_tokens"] for o in outputs)
        cached = sum(o["cached_tokens"] for o in outputs)
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
            outputs=[o["tokens"] for o in outputs],
        )


def run_demo(
    config: Path, conversations: int = 4, turns: int = 4, compare: bool = False
) -> dict[str, DemoResult]:
    """Run the workload with kvtier, then again in a fresh engine on the same tiers (a warm
    restart), and with `compare` without kvtier; results by name."""
    python = ensure_vllm_venv()
    extra = {
        "spec_name": "TieredOffloadingSpec",
        "spec_module_path": "connectors.vllm",
        "config": str(config.resolve()),
    }
    runs: dict[str, dict[str, Any] | None] = {"kvtier": extra, "warm restart": extra}
    if compare:
        runs["vLLM alone"] = None
    results = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as tmp:
        workdir = Path(tmp)
        os.environ.setdefault("KVTIER_DEMO_DIR", str(workdir / "nvme"))
        for name, spec in runs.items():
            scenario = {
                "model_dir": str(workdir / "model"),
                "engine_blocks": ENGINE_BLOCKS,
                "max_model_len": (ENGINE_BLOCKS - 1) * 32,  # vLLM keeps one block spare
                "max_tokens": 16,
                "conversations": chat_workload(conversations, turns),
                "extra": spec,
            }
            results[name] = DemoResult.of(run_scenario(python, scenario, workdir))
    return results
