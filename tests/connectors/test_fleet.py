"""Three real vLLM engines (CPU, the 2-layer Llama of connectors/vllm/run.py) at the same time on
one store, once per shared medium: a 3-master Redis Cluster, SeaweedFS (S3) with packs, one
`files` directory of the file tier (`kvtier.chat_fleet`).

Six conversations of three turns; conversation c's turn t is served by engine (c + t) % 3, so
each returning turn goes to an engine that served no earlier turn of its conversation, and
waits until the engine of the turn before has stored its blocks in the shared store (both
engines up: every engine stays until all have served their turns). Asserted: every turn's
tokens and logprobs equal those of vLLM alone serving the same conversations; every returning
turn found the whole prompt of the turn before in the store (blocks another engine stored,
while it runs), promoted from the shared tier; the store within its capacity, and every object
in it verifies (nothing torn).

Each medium shows one engine's blocks to the others within its visibility bound
(docs/DESIGN.md): Redis and single S3 objects at once, S3 packs within `pack_after` and a
refresh of the pack index, a shared `files` directory at the next existence check.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from kvtier.chat_fleet import (
    ENGINE_BLOCK,
    ChatWorkload,
    FleetRun,
    Store,
    differences,
    files_store,
    inspect_store,
    redis_store,
    run_fleet,
    run_vllm_alone,
    s3_store,
)
from kvtier.servers import RedisClusterServers, SeaweedS3
from tiering.manager.counters import TIER_COUNTERS

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

WORKLOAD = ChatWorkload(engines=3, conversations_per_engine=2, turns=3)
TIMEOUT = 300.0
SOURCE = {
    "redis": "remote_cached_tokens",
    "s3-packs": "remote_cached_tokens",
    "files": "disk_cached_tokens",
}
"""Where vLLM counts the prompt tokens a medium's promotions served."""


class NoCrossEngineHits(AssertionError):
    """A returning turn did not find, in the shared store, the blocks another engine stored."""


@pytest.fixture(scope="module")
def fleet_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fleet")


@pytest.fixture(scope="module")
def vllm_alone(vllm_python: Path, fleet_dir: Path) -> dict[tuple[int, int], dict[str, Any]]:
    workdir = fleet_dir / "vllm-alone"
    workdir.mkdir()
    return run_vllm_alone(vllm_python, WORKLOAD, fleet_dir / "model", workdir, TIMEOUT)


def fleet_on(
    store: Store, vllm_python: Path, fleet_dir: Path, vllm_alone: dict[tuple[int, int], Any]
) -> None:
    workdir = fleet_dir / store.medium
    workdir.mkdir()
    run = run_fleet(vllm_python, WORKLOAD, store, fleet_dir / "model", workdir, TIMEOUT)
    assert_fleet(run, store, vllm_alone)


def assert_fleet(run: FleetRun, store: Store, alone: dict[tuple[int, int], Any]) -> None:
    assert differences(run.turns, alone) == []
    for (c, t), out in run.turns.items():  # no engine served an earlier turn of its turns
        assert out["engine"] not in {run.turns[c, s]["engine"] for s in range(t)}
        if t == 0:
            assert out["cached_tokens"] == 0
    report = inspect_store(store)
    # One object per block any engine stored: each conversation's longest prompt's full blocks
    # (the answers' tokens fill none beyond them here), each once however many engines had it.
    longest = {}
    for (c, _), out in run.turns.items():
        longest[c] = max(longest.get(c, 0), out["prompt_tokens"] // ENGINE_BLOCK)
    assert report.namespaces == 1 and report.objects == sum(longest.values())
    assert report.bad == [] and report.ok == report.checked == report.objects  # nothing torn
    assert store.capacity is not None and report.bytes <= store.capacity

    missing = []
    for (c, t), out in sorted(run.turns.items()):
        if t == 0:
            continue
        stored = run.turns[c, t - 1]["prompt_tokens"] // ENGINE_BLOCK * ENGINE_BLOCK
        if out["cached_tokens"] < stored:
            missing.append(
                f"engine {out['engine']}, conversation {c}, turn {t}: {out['cached_tokens']} "
                f"cached tokens, expected at least the {stored} of the turn before, stored by "
                f"engine {run.turns[c, t - 1]['engine']}"
            )
    for engine, result in enumerate(run.engines):
        if result["metrics"]["tier_promotions"] == 0:
            missing.append(f"engine {engine}: no block promoted from the shared tier")
    if missing:
        raise NoCrossEngineHits("\n".join(missing))
    for engine, result in enumerate(run.engines):
        metrics, outputs = result["metrics"], result["outputs"]
        # Every cached token was promoted from the shared tier: none came from this engine.
        assert metrics[SOURCE[store.medium]] == sum(o["cached_tokens"] for o in outputs), engine
        assert metrics["engine_cached_tokens"] == metrics["host_cached_tokens"] == 0, engine
        if "hits_other_writer" in TIER_COUNTERS:  # the writer tag's counter, where it is
            assert metrics["hits_other_writer"] == metrics["tier_promotions"], engine


@pytest.mark.redis
def test_three_engines_at_once_on_a_redis_cluster(
    vllm_python: Path,
    fleet_dir: Path,
    vllm_alone: dict[tuple[int, int], Any],
    redis_cluster: RedisClusterServers,
) -> None:
    import redis

    for node in redis_cluster.nodes:  # the session's cluster: other tests' keys go
        client = redis.Redis(host="127.0.0.1", port=node.port)
        client.flushall()
        client.close()
    store = redis_store(redis_cluster.url, cluster=True)
    fleet_on(store, vllm_python, fleet_dir, vllm_alone)


@pytest.mark.s3
def test_three_engines_at_once_on_s3_with_packs(
    vllm_python: Path,
    fleet_dir: Path,
    vllm_alone: dict[tuple[int, int], Any],
    s3_server: SeaweedS3,
) -> None:
    store = s3_store(
        s3_server.endpoint,
        s3_server.bucket,
        f"fleet-{uuid.uuid4().hex}/",
        s3_server.ACCESS_KEY,
        s3_server.SECRET_KEY,
        blocks_per_object=4,
    )
    fleet_on(store, vllm_python, fleet_dir, vllm_alone)


def test_three_engines_at_once_on_one_files_directory(
    vllm_python: Path, fleet_dir: Path, vllm_alone: dict[tuple[int, int], Any]
) -> None:
    store = files_store(fleet_dir / "shared-files")
    fleet_on(store, vllm_python, fleet_dir, vllm_alone)
