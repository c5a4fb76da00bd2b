"""Two real vLLM engines (CPU, the 2-layer Llama of connectors/vllm/run.py) with different users
on one shared `files` directory and one Redis, run at once, then restarted at once: each comes
back with its own users' blocks in its primary (issue 33, item 6).

Each engine has its own `primary.engine_id`, a warm start of exactly its users' blocks, and both
tiers written through. The first run serves each engine's users' prompts and shuts down (each
leaves its manifest of use in both stores). The second run, both engines at once again, warms
up on an unrelated prompt, then its users return: every block of theirs must come from the
engine's primary (read there by the warm start, none promoted on the return's path), with the
first run's tokens and logprobs, and the warm start must have read its own users' blocks only.

Without the manifest the warm start reads the shared directory's newest blocks, the fleet's:
both engines would read the same blocks, so at least one reads the other's users' blocks.
"""

from __future__ import annotations

import random
import uuid
from pathlib import Path
from typing import Any

import pytest

from kvtier.scenario import run_scenarios
from kvtier.servers import RedisServer
from tests.helpers.vllm_runs import BLOCK_BYTES, PREFIX, scenario, with_tiers

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.redis]

USERS = 2
"""Users (prompts) per engine."""
TIMEOUT = 240.0


def users(engine: str) -> list[list[int]]:
    """The engine's users' prompts: `PREFIX` tokens (10 full blocks) and a few more each."""
    rng = random.Random(f"fleet-restart-{engine}")
    return [[rng.randrange(3, 1000) for _ in range(PREFIX + 8)] for _ in range(USERS)]


def engine(
    workdir: Path, shared: Path, redis_url: str, name: str, prompts: list[list[int]], **kw: Any
) -> dict[str, Any]:
    own = workdir / name
    own.mkdir(exist_ok=True)
    tiers = [
        {"name": "nvme", "type": "file", "path": str(shared), "min_free": 0, "write": "through"},
        {"name": "redis", "type": "redis", "url": redis_url, "write": "through"},
    ]
    extra = with_tiers(own, tiers)
    extra["kvtier"]["primary"].update(warm_start=USERS * PREFIX // 32 * BLOCK_BYTES, engine_id=name)
    return scenario(workdir, extra, prompts=prompts, **kw)


def test_two_engines_on_one_store_each_restart_into_their_own_users_blocks(
    vllm_python: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    shared = tmp_path / "shared-files"
    names = [f"fleet-{side}-{uuid.uuid4().hex[:8]}" for side in "ab"]  # fresh manifests
    first = run_scenarios(
        vllm_python,
        [
            engine(tmp_path, shared, redis_server.url, name, users(name), settle=True)
            for name in names
        ],
        tmp_path,
        TIMEOUT,
    )
    warmup = [random.Random(0).randrange(3, 1000) for _ in range(40)]
    again = run_scenarios(
        vllm_python,
        [
            engine(tmp_path, shared, redis_server.url, name, [warmup, *users(name)])
            for name in names
        ],
        tmp_path,
        TIMEOUT,
    )
    blocks = USERS * PREFIX // 32
    for name, before, after in zip(names, first, again, strict=True):
        returns = after["outputs"][1:]
        for ours, theirs in zip(returns, before["outputs"], strict=True):
            assert ours["tokens"] == theirs["tokens"], name
            assert ours["logprobs"] == theirs["logprobs"], name
        assert [o["cached_tokens"] for o in returns] == [PREFIX] * USERS, name
        metrics = after["metrics"]
        # Every returning block from the primary, read there by the warm start: its own users'.
        assert metrics["host_cached_tokens"] == USERS * PREFIX, (name, metrics)
        assert metrics["disk_cached_tokens"] == metrics["remote_cached_tokens"] == 0, name
        assert metrics["blocks_warmed"] == blocks, (name, metrics)
        assert "following the last run's manifest of use" in after["log"], name
