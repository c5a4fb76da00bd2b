"""What the tests of a real vLLM engine share (test process): the scenario of
shared/vllm-cpu-e2e.md (its prompts, its kvtier configuration) and what a run's log says."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

PREFIX = 320
BLOCK_BYTES = 32 * 2 * 2 * 2 * 32 * 4  # tokens x layers x (K, V) x KV heads x head size x fp32


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    prefix = [rng.randrange(3, 1000) for _ in range(PREFIX)]
    first = prefix + [rng.randrange(3, 1000) for _ in range(40)]
    unrelated = [rng.randrange(3, 1000) for _ in range(480)]
    again = prefix + [rng.randrange(3, 1000) for _ in range(40)]
    return [first, unrelated, again]


def scenario(workdir: Path, extra: dict[str, Any] | None, **kw: Any) -> dict[str, Any]:
    return {
        "model_dir": str(workdir / "model"),
        "engine_blocks": 18,
        "prompts": kw.pop("prompts", prompts()),
        "extra": extra,
        **kw,
    }


def kvtier_extra(workdir: Path, eviction: str = "lru", **extra: Any) -> dict[str, Any]:
    return {
        "spec_name": "TieredOffloadingSpec",
        "spec_module_path": "connectors.vllm",
        "kvtier": {
            "primary": {"capacity": "8MiB", "eviction": eviction, "directory": str(workdir)}
        },
        **extra,
    }


def with_tiers(
    workdir: Path, tiers: list[dict[str, Any]], capacity: str = "8MiB"
) -> dict[str, Any]:
    extra = kvtier_extra(workdir, "lru")
    extra["kvtier"]["primary"]["capacity"] = capacity
    extra["kvtier"]["tiers"] = tiers
    extra["kvtier"]["promotion"] = {"gate": "always", "deadline": "5s"}
    return extra


def namespaces(result: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any]]]:
    """The namespace each kvtier spec of a run logged: role -> (digest, layout fields)."""
    found = {}
    for line in result["log"].splitlines():
        match = NAMESPACE_LINE.search(line)
        if match:
            found[match["role"]] = (match["digest"], json.loads(match["layout"]))
    return found


NAMESPACE_LINE = re.compile(
    r"kvtier namespace (?P<digest>[0-9a-f]{32}) \((?P<role>scheduler|worker rank \d+)\): "
    r"(?P<layout>\{.*\})$"
)
