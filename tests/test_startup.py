"""Start-up checks of the vLLM connector (no vLLM needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from connectors.startup import check_block_hashing, check_vllm_version, read_config
from tiering.config import PrimaryConfig
from tiering.errors import ConfigError


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
