"""A fleet of real vLLM engines on one store at the same time, under a multi-round chat workload.

The caller's thread (a test, bench/fleet.py). Conversation `c`'s turn `t` is served by engine
`(c + t) % engines`, so every turn after the first goes to another engine than the turn
before it; with no more turns than engines, an engine never served an earlier turn of a
conversation it serves, and each returning prompt's prefix can only come from the blocks
other engines stored. The engines run at once, one process each (`kvtier.scenario.
run_scenarios`), hand the conversations to one another through a directory
(`connectors.rendezvous`: a turn waits until the engine of the turn before it has published
it, after stepping until its blocks were in the shared store) and stay up until all have
served their turns. Here too: vLLM alone serving the same conversations (the outputs a fleet
must match), one engine alone serving one fleet engine's prompts (bench/fleet.py's
reference), and what the shared store holds afterwards, every object of it verified.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.operations import PLACEHOLDER, verify
from kvtier.scenario import run_scenarios
from tiering.config import tier_from_config
from tiering.config.loader import parse_config

__all__ = [
    "ENGINE_BLOCK",
    "VISIBILITY",
    "ChatWorkload",
    "FleetRun",
    "Store",
    "StoreReport",
    "differences",
    "engine_extra",
    "files_store",
    "inspect_store",
    "logprob_deviation",
    "prompts_of",
    "redis_store",
    "run_alone",
    "run_fleet",
    "run_vllm_alone",
    "s3_store",
]

ENGINE_BLOCK = 32
"""Tokens per engine block (`connectors.vllm.run`) and per kvtier block."""
Turn = tuple[int, int]
"""(conversation, turn)."""

VISIBILITY = {"redis": 0.0, "s3": 0.0, "s3-packs": 4.0, "files": 1.0}
"""Seconds a returning turn comes at the earliest after the turn before it ended (the fleet's
`think`), per medium: at least the time the medium may take to show a block one engine stored
to another engine. Redis and single S3 objects show it at once; a block waiting for an S3 pack
is written within `pack_after` (2 s by default) and seen by others at their next refresh of
the pack index (`pack_refresh`, 1 s) and its listing; a `files` directory shows another
engine's file at the next check of the directory (1 s leaves room)."""


@dataclass(frozen=True, slots=True)
class ChatWorkload:
    """Conversations of `turns` user messages each, `conversations_per_engine` per engine:
    a first message of `first_tokens`, later ones of `message_tokens`, answers of
    `answer_tokens` (greedy, `ignore_eos`). `model`: the scenario's `model` (None: the 2-layer
    Llama of `connectors.vllm.run`); `engine_blocks`: each engine's own KV cache."""

    engines: int = 3
    conversations_per_engine: int = 2
    turns: int = 3
    first_tokens: int = 160
    message_tokens: int = 64
    answer_tokens: int = 8
    warmup_tokens: int = 16
    engine_blocks: int = 18
    max_model_len: int = 512
    primary_capacity: str = "8MiB"
    model: dict[str, Any] | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.engines < 1 or self.turns < 1 or self.conversations_per_engine < 1:
            raise ValueError("a fleet needs at least one engine, conversation and turn")
        longest = self.first_tokens + (self.turns - 1) * self.message_tokens
        longest += self.turns * self.answer_tokens
        if longest > self.max_model_len:
            raise ValueError(
                f"a conversation grows to {longest} tokens, over max_model_len {self.max_model_len}"
            )

    @property
    def conversations(self) -> int:
        return self.engines * self.conversations_per_engine

    def engine_of(self, conversation: int, turn: int) -> int:
        return (conversation + turn) % self.engines

    def messages(self) -> list[list[list[int]]]:
        """The user messages of every conversation (token ids 3 to 999: never BOS or EOS)."""
        rng = random.Random(f"fleet-{self.seed}")
        sizes = [self.first_tokens] + [self.message_tokens] * (self.turns - 1)
        return [
            [[rng.randrange(3, 1000) for _ in range(n)] for n in sizes]
            for _ in range(self.conversations)
        ]

    def schedule(self) -> list[list[Turn]]:
        """Each engine's turns in the order it serves them: turn by turn, conversations in
        order."""
        turns: list[list[Turn]] = [[] for _ in range(self.engines)]
        for t in range(self.turns):
            for c in range(self.conversations):
                turns[self.engine_of(c, t)].append((c, t))
        return turns

    def warmup(self, engine: int) -> list[int]:
        """A prompt of `warmup_tokens` of this engine's own (no other engine has it)."""
        rng = random.Random(f"fleet-{self.seed}-warmup-{engine}")
        return [rng.randrange(3, 1000) for _ in range(self.warmup_tokens)]

    def scenario(self, **keys: Any) -> dict[str, Any]:
        """The keys of `kvtier.scenario` every engine of this workload shares, and `keys`."""
        base = {
            "engine_blocks": self.engine_blocks,
            "max_model_len": self.max_model_len,
            "max_tokens": self.answer_tokens,
            **({"model": self.model} if self.model is not None else {}),
        }
        return base | keys


@dataclass(frozen=True, slots=True)
class Store:
    """The store the engines share: its medium (a key of `VISIBILITY`) and the kvtier tier
    entry every engine is given."""

    medium: str
    tier: dict[str, Any]

    @property
    def think(self) -> float:
        return VISIBILITY[self.medium]

    @property
    def capacity(self) -> int | None:
        (cfg,) = parse_config({"version": 1, "tiers": [self.tier]}).tiers
        return cfg.capacity


def redis_store(url: str, *, cluster: bool = False, capacity: str = "64MiB") -> Store:
    tier = {"name": "shared", "type": "redis", "url": url, "cluster": cluster}
    return Store("redis", {**tier, "write": "through", "capacity": capacity})


def s3_store(
    endpoint: str,
    bucket: str,
    prefix: str,
    access_key: str,
    secret_key: str,
    *,
    blocks_per_object: int = 1,
    capacity: str = "64MiB",
) -> Store:
    tier = {
        "name": "shared",
        "type": "s3",
        "bucket": bucket,
        "prefix": prefix,
        "endpoint_url": endpoint,
        "access_key": access_key,
        "secret_key": secret_key,
        "blocks_per_object": blocks_per_object,
    }
    medium = "s3" if blocks_per_object == 1 else "s3-packs"
    return Store(medium, {**tier, "write": "through", "capacity": capacity})


def files_store(path: Path, *, capacity: str = "64MiB") -> Store:
    tier = {"name": "shared", "type": "file", "path": str(path), "layout": "files"}
    return Store("files", {**tier, "min_free": 0, "write": "through", "capacity": capacity})


def engine_extra(store: Store, primary: Path, capacity: str) -> dict[str, Any]:
    """`kv_connector_extra_config` of an engine on `store`: a CPU primary of `capacity` (its
    region in `primary`), the shared tier written through, every tier hit promoted. Tier calls
    and promotions get 5 s: engines sharing a CPU (two cores for three engines here) make a
    check or a promotion slow, and that should measure slow, not miss."""
    return {
        "spec_name": "TieredOffloadingSpec",
        "spec_module_path": "connectors.vllm",
        "kvtier": {
            "version": 1,
            "primary": {"capacity": capacity, "directory": str(primary)},
            "tiers": [store.tier],
            "promotion": {"gate": "always", "deadline": "5s"},
            "faults": {"timeout": "5s"},
        },
    }


@dataclass(frozen=True, slots=True)
class FleetRun:
    """What the engines of one fleet run produced: `engines`, each engine's scenario result
    (`kvtier.scenario.run_scenario`'s; outputs labelled with their `conversation`, `turn` and
    `waited`); `turns`, every output by (conversation, turn), with its `engine`."""

    engines: list[dict[str, Any]]
    turns: dict[Turn, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def of(cls, results: list[dict[str, Any]]) -> FleetRun:
        turns = {}
        for engine, result in enumerate(results):
            for out in result["outputs"]:
                turns[out["conversation"], out["turn"]] = {**out, "engine": engine}
        return cls(results, turns)


def run_fleet(
    python: Path,
    workload: ChatWorkload,
    store: Store | Sequence[Store] | None,
    model_dir: Path,
    workdir: Path,
    timeout: float = 600,
    progress: Callable[[int, str], None] | None = None,
) -> FleetRun:
    """The workload's engines at once on `store` (one per engine: each engine on its own; None:
    vLLM alone in every engine, no kvtier), in `workdir` (a fresh directory: the engines'
    primaries and their rendezvous); the model is written in `model_dir` unless it is there."""
    messages = workload.messages()
    scenarios = []
    stores = [store] * workload.engines if store is None or isinstance(store, Store) else store
    if len(stores) != workload.engines:
        raise ValueError(f"{len(stores)} stores for {workload.engines} engines")
    for engine, (turns, own) in enumerate(zip(workload.schedule(), stores, strict=True)):
        primary = workdir / f"primary-{engine}"
        primary.mkdir(parents=True, exist_ok=True)
        fleet = {
            "dir": str(workdir / "rendezvous"),
            "engine": engine,
            "engines": workload.engines,
            "turns": turns,
            "think": max((s.think for s in stores if s is not None), default=0.0),
            "timeout": timeout,
        }
        extra = None if own is None else engine_extra(own, primary, workload.primary_capacity)
        scenarios.append(
            workload.scenario(
                model_dir=str(model_dir),
                conversations=messages,
                fleet=fleet,
                warmup=workload.warmup(engine),
                extra=extra,
            )
        )
    return FleetRun.of(run_scenarios(python, scenarios, workdir, timeout, progress))


def run_vllm_alone(
    python: Path, workload: ChatWorkload, model_dir: Path, workdir: Path, timeout: float = 600
) -> dict[Turn, dict[str, Any]]:
    """One engine of vLLM alone (no kvtier) serving every conversation, turn by turn: each
    output by (conversation, turn)."""
    scenario = workload.scenario(
        model_dir=str(model_dir),
        conversations=workload.messages(),
        warmup=workload.warmup(workload.engines),
        extra=None,
    )
    (result,) = run_scenarios(python, [scenario], workdir, timeout)
    order = [(c, t) for t in range(workload.turns) for c in range(workload.conversations)]
    return dict(zip(order, result["outputs"], strict=True))


def prompts_of(workload: ChatWorkload, answers: dict[Turn, Sequence[int]]) -> dict[Turn, list[int]]:
    """The prompt of every turn, given the answers of the turns before it."""
    prompts = {}
    for c, messages in enumerate(workload.messages()):
        history: list[int] = []
        for t, message in enumerate(messages):
            history += message
            prompts[c, t] = list(history)
            history += answers[c, t]
    return prompts


def run_alone(
    python: Path,
    workload: ChatWorkload,
    engine: int,
    prompts: dict[Turn, list[int]],
    store: Store,
    model_dir: Path,
    workdir: Path,
    timeout: float = 600,
) -> dict[str, Any]:
    """One engine alone, as engine `engine` of the fleet is (the same kvtier config, on
    `store`, which should be empty), serving that engine's prompts in the same order, one at a
    time; its scenario result."""
    primary = workdir / f"primary-alone-{engine}"
    primary.mkdir(parents=True, exist_ok=True)
    scenario = workload.scenario(
        model_dir=str(model_dir),
        prompts=[prompts[turn] for turn in workload.schedule()[engine]],
        warmup=workload.warmup(engine),
        extra=engine_extra(store, primary, workload.primary_capacity),
    )
    (result,) = run_scenarios(python, [scenario], workdir, timeout)
    return result


def differences(
    got: dict[Turn, dict[str, Any]],
    expected: dict[Turn, dict[str, Any]],
    logprob_tolerance: float = 0.0,
) -> list[str]:
    """Every turn whose tokens are not those of `expected`, whose logprobs differ from its by
    more than `logprob_tolerance`, or that is missing. (On the 2-layer Llama, loaded KV gives
    the very logprobs of recomputed KV; on a model as wide as the demo's, the sums of a prefill
    cut elsewhere differ in their last bits.)"""
    problems = []
    for turn in sorted(expected.keys() | got.keys()):
        where = f"conversation {turn[0]}, turn {turn[1]}"
        if turn not in got or turn not in expected:
            problems.append(f"{where}: served by one run only")
            continue
        ours, theirs = got[turn], expected[turn]
        if ours["tokens"] != theirs["tokens"]:
            problems.append(f"{where}: tokens {ours['tokens']}, expected {theirs['tokens']}")
        elif logprob_deviation(ours, theirs) > logprob_tolerance:
            problems.append(f"{where}: logprobs {ours['logprobs']}, expected {theirs['logprobs']}")
    return problems


def logprob_deviation(ours: dict[str, Any], theirs: dict[str, Any]) -> float:
    """The largest difference between the logprobs of two outputs of the same tokens."""
    pairs = zip(ours["logprobs"], theirs["logprobs"], strict=True)
    return max((abs(a - b) for a, b in pairs), default=0.0)


@dataclass(frozen=True, slots=True)
class StoreReport:
    """What a store holds over every namespace in it (read by a tier of its own, after the
    engines), and what reading each object back found."""

    namespaces: int
    objects: int
    bytes: int
    checked: int
    ok: int
    bad: list[tuple[str, str]]


def inspect_store(store: Store) -> StoreReport:
    """Count and verify every object the store holds, in every namespace (`kvtier verify`'s
    check: header, namespace, lengths, checksum), read-only."""
    config = parse_config({"version": 1, "tiers": [store.tier]})
    (cfg,) = config.tiers

    async def go() -> StoreReport:
        async with tier_from_config(cfg, PLACEHOLDER, config, read_only=True) as probe:
            namespaces = await probe.namespaces()
        objects = size = checked = ok = 0
        bad: list[tuple[str, str]] = []
        for namespace in namespaces:
            async with tier_from_config(cfg, namespace, config, read_only=True) as tier:
                stat = await tier.stat()
                report = await verify(tier)
            objects, size = objects + stat.objects, size + stat.bytes_used
            checked, ok = checked + report.checked, ok + report.ok
            bad += report.bad
        return StoreReport(len(namespaces), objects, size, checked, ok, bad)

    return asyncio.run(go())
