"""The scenarios the interface tests run, each in an `Engine` of its own; each returns what it
observed as plain data (`test_vllm_interface.py` asserts on it in kvtier's environment).

The shared-prefix scenario of shared/vllm-cpu-e2e.md: the engine holds 18 blocks of 32 tokens;
`first` (a 320-token prefix and 40 tokens of its own), `unrelated` (480 tokens, which evicts the
prefix from the engine's blocks), then `again` (the prefix and 40 other tokens), one at a time,
8 tokens each. The engine's prefix cache still holds the prefix's first block; the other nine
must come from kvtier.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import vllm

from tests.connectors.vllm_harness.engine import Engine, engine
from tiering.keys import BlockKey
from tiering.registry import register_tier
from tiering.tier import KeyLike
from tiers.copy.base import CopyJob, Direction
from tiers.file.files import BlockFileTier

__all__ = ["SCENARIOS", "prompts"]

PREFIX = 320
MAX_TOKENS = 8
SLOT_BYTES = (
    32 * 2 * 2 * 2 * 32 * 4
)  # one engine block: tokens x layers x (K, V) x heads x dim x fp32
READ_DELAY = 0.5
"""Seconds each read of scenario c's file tier waits first: its promotions stay in flight."""


def prompts() -> dict[str, list[int]]:
    rng = random.Random(0)
    prefix = [rng.randrange(3, 1000) for _ in range(PREFIX)]
    return {
        "first": prefix + [rng.randrange(3, 1000) for _ in range(40)],
        "unrelated": [rng.randrange(3, 1000) for _ in range(480)],
        "again": prefix + [rng.randrange(3, 1000) for _ in range(40)],
        "other": [rng.randrange(3, 1000) for _ in range(200)],
    }


def kvtier_extra(
    workdir: Path, spec: str = "TieredOffloadingSpec", **kvtier: Any
) -> dict[str, Any]:
    module = (
        "connectors.vllm"
        if spec == "TieredOffloadingSpec"
        else "tests.connectors.vllm_specs.canary"
    )
    config = {"primary": {"capacity": "8MiB", "directory": str(workdir)}, **kvtier}
    return {"spec_name": spec, "spec_module_path": module, "kvtier": config}


def observed(e: Engine) -> dict[str, Any]:
    """What every scenario reports: per request its block table, the tokens found computed
    when first scheduled, the tokens it produced; the blocks the forward found holding other
    bytes than their tokens'; the call log."""
    return {
        "vllm": vllm.__version__,
        "requests": {
            name: {
                "first_computed": state.first_computed,
                "block_ids": state.block_ids,
                "output_tokens": len(state.content.tokens) - state.prompt_len,
            }
            for name, state in e.runner.requests.items()
        },
        "checked_blocks": e.runner.checked_blocks,
        "mismatched_blocks": sorted({(m.request, m.block_index) for m in e.runner.mismatches}),
        "events": [event.as_json() for event in e.events],
        "unfinished": e.scheduler.has_requests(),
        "steps": e.steps,
    }


def shared_prefix(workdir: Path, extra: dict[str, Any]) -> dict[str, Any]:
    with engine(workdir, extra) as e:
        for name, prompt in prompts().items():
            if name == "other":
                continue
            e.add_request(name, prompt, MAX_TOKENS)
            e.run()
        return observed(e)


def scenario_a(workdir: Path) -> dict[str, Any]:
    """a: the shared-prefix scenario with kvtier."""
    return shared_prefix(workdir, kvtier_extra(workdir))


def scenario_record(workdir: Path) -> dict[str, Any]:
    """record: a with `trace.record`; the lines recorded, read after the engine's shutdown."""
    path = workdir / "trace.jsonl"
    found = shared_prefix(workdir, kvtier_extra(workdir, trace={"record": str(path)}))
    found["recorded"] = [json.loads(line) for line in path.read_text().splitlines()]
    return found


def scenario_canary(workdir: Path) -> dict[str, Any]:
    """a with the canary spec, whose loads copy nothing: the check must see it."""
    return shared_prefix(workdir, kvtier_extra(workdir, "CanarySpec"))


def scenario_b(workdir: Path) -> dict[str, Any]:
    """b: a, with a per-step budget for loads done inside the step (vLLM 0.33; 0.32 ignores
    the key). 1 MiB holds the nine blocks of `again` (288 KiB)."""
    extra = kvtier_extra(workdir) | {"sync_load_budget_bytes": 1 << 20}
    return shared_prefix(workdir, extra)


class SlowReadsFileTier(BlockFileTier):
    """The file tier (`layout: files`) whose every read first waits `READ_DELAY`, on the
    runtime's event loop like any tier call, so that promotions from it are in flight when
    scenario c resets the cache. Counts reads begun and ended. Runtime thread."""

    begun = 0
    ended = 0

    @classmethod
    def variant(cls, options: Mapping[str, Any]) -> type[BlockFileTier]:
        return cls

    async def _read(self, key: BlockKey, limit: int) -> Any:
        async with _slow_read():
            return await super()._read(key, limit)

    async def _read_into(self, key: BlockKey, payload: memoryview, limit: int) -> Any:
        async with _slow_read():
            return await super()._read_into(key, payload, limit)

    async def get_many(self, items: Sequence[tuple[KeyLike, memoryview | bytearray]]) -> Any:
        if len(items) < 2:  # one block: `_read_into`
            return await super().get_many(items)
        async with _slow_read():  # a batch bypasses the two above
            return await super().get_many(items)


@asynccontextmanager
async def _slow_read() -> AsyncIterator[None]:
    SlowReadsFileTier.begun += 1
    try:
        await asyncio.sleep(READ_DELAY)
        yield
    finally:
        SlowReadsFileTier.ended += 1


def slow_file_extra(workdir: Path) -> dict[str, Any]:
    """A primary of 16 slots in front of a write-through file tier whose reads take
    `READ_DELAY` (scenarios c and idle)."""
    register_tier("slow-file", SlowReadsFileTier, replace=True)
    return kvtier_extra(
        workdir,
        primary={"capacity": 16 * SLOT_BYTES, "directory": str(workdir)},
        tiers=[
            {
                "name": "disk",
                "type": "slow-file",
                "path": str(workdir / "disk"),
                "write": "through",
                "min_free": 0,
            }
        ],
        promotion={"deadline": "30s", "gate": "always"},
        faults={"timeout": "10s"},
    )


def scenario_c(workdir: Path) -> dict[str, Any]:
    """c: a reset of the cache while promotions from a file tier are in flight.

    A primary of 16 slots (a request's stores must fit: `unrelated` stores 15 blocks in one
    step) and a write-through file tier: `first`'s blocks are on disk, and `unrelated`'s
    stores push them out of the primary. Then `again` and `other` (200 tokens of its own)
    arrive: one step looks `again` up (HIT_PENDING: kvtier queues promotions from the disk)
    and computes `other` (whose store job the connector defers to the next step). Between
    that step and the next, once the promotions are reading, the engine resets its prefix
    cache and kvtier's (`reset_running_requests`: `other` is preempted and computed again).
    Then everything runs to the end: `again` must get its whole prefix from kvtier again.
    """
    extra = slow_file_extra(workdir)
    requests = prompts()
    with engine(workdir, extra) as e:
        for name in ("first", "unrelated"):
            e.add_request(name, requests[name], MAX_TOKENS)
            e.run()
        e.add_request("again", requests["again"], MAX_TOKENS)
        e.add_request("other", requests["other"], MAX_TOKENS)
        begun = SlowReadsFileTier.begun
        e.step()
        _wait_until(lambda: SlowReadsFileTier.begun > begun)  # the runtime, between steps
        in_flight = SlowReadsFileTier.begun - SlowReadsFileTier.ended
        running = [r.request_id for r in e.scheduler.running]
        # The connector's jobs not yet reported by the worker (private, read only): those a
        # vLLM 0.33 scheduler fences until `on_reset_flushed`.
        jobs = sorted(e.scheduler.connector.connector_scheduler._jobs)
        reset = e.reset_cache(reset_running_requests=True)
        e.run()
        return observed(e) | {
            "reset_ok": reset,
            "reads_in_flight_at_reset": in_flight,
            "running_at_reset": running,
            "jobs_in_flight_at_reset": jobs,
        }


def scenario_idle(workdir: Path) -> dict[str, Any]:
    """idle: `again` waits for promotions from a file tier whose reads take `READ_DELAY`, and
    nothing else runs: the engine's steps schedule nothing meanwhile. kvtier's manager must see
    those steps as empty (from `build_connector_meta`'s argument) and wait in them rather than
    let the engine spin (`TieringOffloadingManager.on_schedule_end`, `idle`)."""
    extra = slow_file_extra(workdir)
    requests = prompts()
    with engine(workdir, extra) as e:
        for name in ("first", "unrelated"):
            e.add_request(name, requests[name], MAX_TOKENS)
            e.run()
        manager = e.scheduler.connector.connector_scheduler.manager.manager
        steps, waits = e.steps, manager.counters["idle_waits"]
        began = time.monotonic()
        e.add_request("again", requests["again"], MAX_TOKENS)
        e.run()
        return observed(e) | {
            "again_steps": e.steps - steps,
            "again_seconds": time.monotonic() - began,
            "idle_waits": manager.counters["idle_waits"] - waits,
        }


def scenario_warm(workdir: Path) -> dict[str, Any]:
    """warm: a restart with the warm start. A first engine with a write-through file tier
    serves `first` and stops; a second one on the same tier, whose primary the warm start fills
    from the tier before any request (`primary.warm_start`), serves `again`: its prefix must be
    loaded from the primary, with the bytes `first` stored, and no lookup must wait on a
    promotion."""
    primary = {"capacity": 16 * SLOT_BYTES, "directory": str(workdir)}
    tier = {
        "name": "disk",
        "type": "file",
        "path": str(workdir / "warm-disk"),
        "write": "through",
        "min_free": 0,
    }
    requests = prompts()
    with engine(workdir, kvtier_extra(workdir, primary=primary, tiers=[tier])) as e:
        e.add_request("first", requests["first"], MAX_TOKENS)
        e.run()
    warm = kvtier_extra(workdir, primary={**primary, "warm_start": 16 * SLOT_BYTES}, tiers=[tier])
    with engine(workdir, warm) as e:
        manager = e.scheduler.connector.connector_scheduler.manager.manager
        warming = manager.warm
        _wait_until(lambda: warming.budget == 0 and not warming.warming)
        warmed = manager.snapshot()["manager"]["blocks_warmed"]
        e.add_request("again", requests["again"], MAX_TOKENS)
        e.run()
        return observed(e) | {"blocks_warmed": warmed}


def scenario_drift(workdir: Path) -> dict[str, Any]:
    """drift: the kvtier config file is edited between the worker's start and the scheduler's
    (its `primary.directory`; a write-through file tier stays as it was). Each role would map
    a primary region of its own, and the scheduler would demote slots nobody wrote: the
    scheduler must refuse to start, naming both regions, before its tiers are built."""
    disk = workdir / "drift-disk"
    tier = {"name": "disk", "type": "file", "path": str(disk), "write": "through", "min_free": 0}
    config = workdir / "kvtier.yaml"

    def write(directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        primary = {"capacity": 16 * SLOT_BYTES, "directory": str(directory)}
        config.write_text(json.dumps({"primary": primary, "tiers": [tier]}))  # JSON is YAML

    workdir.mkdir(parents=True, exist_ok=True)
    write(workdir / "shm-a")
    extra = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "connectors.vllm"}
    refused = None
    try:
        started = Engine(
            workdir, extra | {"config": str(config)}, between_roles=lambda: write(workdir / "shm-b")
        )
    except Exception as e:
        refused = f"{type(e).__name__}: {e}"
    else:
        started.close()
    return {
        "vllm": vllm.__version__,
        "refused": refused,
        "tier_files": sorted(str(p.relative_to(disk)) for p in disk.rglob("*"))
        if disk.exists()
        else None,
        "regions_left": sorted(p.name for p in workdir.glob("shm-*/kvtier-*.region")),
    }


def _inject_copy_faults(
    e: Engine, direction: Direction, *, expedited: bool | None = None
) -> list[int]:
    """Make every later copy job of `direction` (and, if given, of that lane) fail inside the
    worker's CPU copy engine, as a failed copy does: the engine reports the job failed. Returns
    the list the failed job ids are appended to."""
    failed: list[int] = []
    engine_ = e.connector.connector_worker.worker.inner.engine

    def fault(job: CopyJob) -> None:
        if job.direction is direction and (expedited is None or job.expedited == expedited):
            failed.append(job.job_id)
            raise OSError(f"injected fault in copy job {job.job_id}")

    engine_._fault = fault  # the CPU engine's test hook (`CpuCopyEngine(fault=...)`)
    return failed


def _manager_counters(e: Engine) -> dict[str, float]:
    return dict(e.scheduler.connector.connector_scheduler.manager.manager.counters)


def _failure_scenario(
    workdir: Path, extra: dict[str, Any], direction: Direction, **engine_args: Any
) -> dict[str, Any]:
    """`first` runs with every copy of `direction` failing, then `unrelated` and `again`
    with working copies (a failed store) or with loads failing throughout (a failed load).
    What vLLM does with the failure is its release's rule; the harness reports what it saw,
    the error a step raised included."""
    requests = prompts()
    raised = None
    failed: list[int] = []
    with engine(workdir, extra, **engine_args) as e:
        try:
            failed = _inject_copy_faults(e, direction)
            for name in ("first", "unrelated", "again"):
                if name == "unrelated" and direction is Direction.STORE:
                    e.connector.connector_worker.worker.inner.engine._fault = None
                e.add_request(name, requests[name], MAX_TOKENS)
                e.run()
        except Exception as error:  # vLLM's own rule for a failure it cannot survive
            raised = f"{type(error).__name__}: {error}"
        found = observed(e)
        counters = _manager_counters(e)
        pool = e.scheduler.connector.connector_scheduler.manager.manager.pool
    return found | {
        "raised": raised,
        "injected": failed,
        "stores_failed": counters.get("stores_failed", 0),
        "store_completions_ignored": counters.get("store_completions_ignored", 0),
        "errored": sorted(e.errored),
        "slots_reading": pool.num_reading,
        "slots_writing": pool.num_writing,
    }


def scenario_failed_store(workdir: Path) -> dict[str, Any]:
    """failed_store: `first`'s stores all fail in the copy engine. From vLLM 0.34 the manager
    drops them (`complete_store(..., success=False)`): `again` finds nothing of the prefix in
    kvtier and recomputes it, every block exact. Before 0.34 vLLM stops on the failure."""
    return _failure_scenario(workdir, kvtier_extra(workdir), Direction.STORE)


def scenario_failed_load(workdir: Path) -> dict[str, Any]:
    """failed_load: every load fails in the copy engine, under vLLM's `kv_load_failure_policy:
    recompute`. From vLLM 0.34 `again`'s load is reported failed (`failed_recving`) and the
    request recomputes what it did not load, every block exact. Before 0.34 vLLM stops on the
    failure."""
    return _failure_scenario(
        workdir, kvtier_extra(workdir), Direction.LOAD, load_failure_policy="recompute"
    )


def scenario_failed_load_default(workdir: Path) -> dict[str, Any]:
    """failed_load_default: failed_load under vLLM's default policy (`fail`): from 0.34 the
    request whose load failed ends with an error and the engine goes on."""
    return _failure_scenario(workdir, kvtier_extra(workdir), Direction.LOAD)


def scenario_failed_expedited(workdir: Path) -> dict[str, Any]:
    """failed_expedited: b (loads inside the step) with every load failing. vLLM 0.34's rule:
    a failed expedited load raises in the connector (its request already ran on the unloaded
    KV); kvtier itself raises nothing."""
    extra = kvtier_extra(workdir) | {"sync_load_budget_bytes": 1 << 20}
    return _failure_scenario(workdir, extra, Direction.LOAD)


def scenario_preempt(workdir: Path) -> dict[str, Any]:
    """preempt: three requests of 128 tokens (4 blocks) that each decode 160 tokens share the
    engine's 18 blocks: they start together, outgrow it together (9 blocks each) and the
    scheduler preempts one, which resumes later (its stores in flight flushed by the connector
    first, its prefix loaded back from kvtier). Every block the forward reads must hold its own
    tokens' bytes."""
    rng = random.Random(1)
    with engine(workdir, kvtier_extra(workdir)) as e:
        for name in ("p", "q", "r"):
            e.add_request(name, [rng.randrange(3, 1000) for _ in range(128)], 160)
        e.run()
        return observed(e) | {"resumed": e.runner.resumed}


def _tier_entries() -> dict[str, dict[str, Any]]:
    """The secondary tiers of scenario restart, by kind: a `files` and a `segments` directory
    always; Redis and S3 (single objects and packs) where the test gives their servers
    (`KVTIER_HARNESS_TIERS`: JSON, kind -> tier entry without its name)."""
    return json.loads(os.environ.get("KVTIER_HARNESS_TIERS", "{}"))


def scenario_restart(workdir: Path) -> dict[str, Any]:
    """restart: for each kind of secondary tier, an engine serves `first` and stops with its
    blocks written through to the tier; a second engine on the same tier (a fresh primary,
    no warm start) serves `again`: its prefix is promoted from the tier and loaded, every
    block exact."""
    kinds: dict[str, dict[str, Any]] = {
        "files": {"type": "file", "path": str(workdir / "files"), "layout": "files", "min_free": 0},
        "segments": {
            "type": "file",
            "path": str(workdir / "segments"),
            "layout": "segments",
            "min_free": 0,
        },
        **_tier_entries(),
    }
    requests = prompts()
    found: dict[str, Any] = {"vllm": vllm.__version__}
    for kind, entry in kinds.items():
        tier = {"name": "disk", **entry, "write": "through"}
        primary = {"capacity": 16 * SLOT_BYTES, "directory": str(workdir / kind)}
        extra = kvtier_extra(
            workdir / kind,
            primary=primary,
            tiers=[tier],
            promotion={"deadline": "30s", "gate": "always"},
        )
        with engine(workdir / kind, extra) as e:
            e.add_request("first", requests["first"], MAX_TOKENS)
            e.run()
        with engine(workdir / kind, extra) as e:
            e.add_request("again", requests["again"], MAX_TOKENS)
            e.run()
            stats = e.scheduler.connector.connector_scheduler.manager.manager.stats()
            found[kind] = observed(e) | {"promotions": stats["tiers"]["disk"]["promotions"]}
    return found


def _wait_until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached in {timeout} s")
        time.sleep(0.001)


SCENARIOS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "a": scenario_a,
    "canary": scenario_canary,
    "record": scenario_record,
    "b": scenario_b,
    "c": scenario_c,
    "idle": scenario_idle,
    "warm": scenario_warm,
    "drift": scenario_drift,
    "failed_store": scenario_failed_store,
    "failed_load": scenario_failed_load,
    "failed_load_default": scenario_failed_load_default,
    "failed_expedited": scenario_failed_expedited,
    "preempt": scenario_preempt,
    "restart": scenario_restart,
}
