"""Start-up checks of the vLLM connector (no vLLM needed)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from connectors.startup import (
    check_block_hashing,
    check_vllm_version,
    namespace_layout,
    read_config,
)
from tiering.config import PrimaryConfig
from tiering.errors import ConfigError
from tiering.keys import Layout


@pytest.mark.parametrize("version", ["0.32.0", "0.32.3", "0.32.1rc1"])
def test_supported_versions(version: str) -> None:
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.33.0", "0.31.2", "1.0.0"])
def test_unsupported_version_says_which(version: str) -> None:
    with pytest.raises(ConfigError, match=f"kvtier supports vLLM 0.32.x; found vLLM {version}"):
        check_vllm_version(version)


def test_unstable_hashing_with_lasting_tiers_names_the_setting() -> None:
    with pytest.raises(ConfigError, match="--prefix-caching-hash-algo sha256.*PYTHONHASHSEED"):
        check_block_hashing("xxhash", None, ["nvme", "redis"])
    check_block_hashing("xxhash", "0", ["nvme"])  # a shared seed makes xxhash stable
    check_block_hashing("sha256", None, ["nvme"])  # stable by default
    check_block_hashing("xxhash", None, [])  # nothing lasts beyond the process


def test_config_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "tiers.yaml"
    path.write_text("primary: {capacity: 1GiB, eviction: arc}\n")
    assert read_config({"config": str(path)}).primary == PrimaryConfig(2**30, "arc")


def test_config_inline_and_default() -> None:
    inline = read_config({"kvtier": {"primary": {"eviction": "arc"}}})
    assert inline.primary.eviction == "arc" and inline.primary.capacity is None
    assert read_config({}).primary == PrimaryConfig()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"config": "/nowhere/tiers.yaml"}, "/nowhere/tiers.yaml: cannot read config"),
        ({"config": 5}, "kv_connector_extra_config.config: expected a path"),
        (
            {"kvtier": {"primary": {"capacity": "lots"}}},
            "kv_connector_extra_config.kvtier: primary.capacity",
        ),
        ({"config": "a.yaml", "kvtier": {}}, "either 'config'"),
    ],
)
def test_config_errors(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        read_config(extra)


def offloading_config(**changes: object) -> SimpleNamespace:
    config = SimpleNamespace(
        model=SimpleNamespace(name="meta-llama/Llama-3.1-8B", dtype="bfloat16"),
        groups=[SimpleNamespace(tokens_per_block=16, layer_names=[f"l{i}" for i in range(32)])],
        kv_cache_layout="LBHNC",
        worker_kv_bytes_per_block=2 * 32 * 16 * 8 * 128 * 2,
        parallel=SimpleNamespace(tp_size=2, pp_size=1),
    )
    for key, value in changes.items():
        setattr(config, key, value)
    return config


def vllm_config(revision: str | None = "abc123") -> SimpleNamespace:
    model = SimpleNamespace(
        revision=revision, get_total_num_kv_heads=lambda: 8, get_head_size=lambda: 128
    )
    return SimpleNamespace(model_config=model)


def test_namespace_from_the_engine_config() -> None:
    layout = namespace_layout(offloading_config(), vllm_config(), blocks_per_chunk=4)
    assert layout == Layout(
        model="meta-llama/Llama-3.1-8B",
        revision="abc123",
        dtype="bfloat16",
        kv_layout="LBHNC",
        page_size_bytes=2 * 32 * 16 * 8 * 128 * 2,
        tokens_per_block=64,
        num_layers=32,
        num_kv_heads=8,
        head_size=128,
        tp_size=2,
        pp_size=1,
    )


def test_namespace_separates_what_makes_kv_differ() -> None:
    base = namespace_layout(offloading_config(), vllm_config(), 1).namespace()
    assert namespace_layout(offloading_config(), vllm_config(), 2).namespace() != base
    assert namespace_layout(offloading_config(), vllm_config("other"), 1).namespace() != base
    tp4 = offloading_config(parallel=SimpleNamespace(tp_size=4, pp_size=1))
    assert namespace_layout(tp4, vllm_config(), 1).namespace() != base
    fp8 = offloading_config(model=SimpleNamespace(name="meta-llama/Llama-3.1-8B", dtype="fp8"))
    assert namespace_layout(fp8, vllm_config(), 1).namespace() != base
    assert namespace_layout(offloading_config(), vllm_config(None), 1).revision == ""
