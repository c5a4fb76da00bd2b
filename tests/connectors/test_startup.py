"""Start-up checks of the vLLM connector (no vLLM needed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from connectors.identity import model_identity
from connectors.startup import (
    check_block_hashing,
    lasting_tiers,
    namespace_layout,
    primary_capacity,
    read_config,
)
from tests.helpers.model_files import write_model
from tiering.config import PrimaryConfig, parse_config
from tiering.errors import ConfigError
from tiering.keys import Layout


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


def test_a_warm_start_larger_than_the_primary_is_refused_naming_both() -> None:
    """`primary.warm_start` over the primary's capacity was accepted (a warm start fills free
    slots only, so it stopped short without a word): refused against `primary.capacity` at
    load, and against vLLM's `cpu_bytes_to_use` when that gives the capacity."""
    inline = {"kvtier": {"primary": {"capacity": "1GiB", "warm_start": "2GiB"}}}
    with pytest.raises(ConfigError) as error:
        read_config(inline)
    assert str(error.value) == (
        "kv_connector_extra_config.kvtier: primary.warm_start: 2GiB is more than "
        "primary.capacity (1GiB); a warm start fills at most the primary"
    )
    config = read_config({"kvtier": {"primary": {"warm_start": "2GiB"}}})
    with pytest.raises(ConfigError) as error:
        primary_capacity(config, {"cpu_bytes_to_use": 1 << 30})
    assert str(error.value) == (
        "primary.warm_start: 2GiB is more than cpu_bytes_to_use (1GiB); a warm start fills "
        "at most the primary"
    )
    assert primary_capacity(config, {"cpu_bytes_to_use": "2GiB"}) == 2 << 30
    exact = read_config({"kvtier": {"primary": {"capacity": "1GiB", "warm_start": "1GiB"}}})
    assert primary_capacity(exact, {"cpu_bytes_to_use": 1}) == 1 << 30  # the YAML's wins
    with pytest.raises(ConfigError, match="needs a primary capacity"):
        primary_capacity(config, {})


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


def vllm_config(model_path: Path, **changes: object) -> SimpleNamespace:
    """The parts of a `VllmConfig` the namespace reads, as vLLM hands them to the connector."""
    settings: dict[str, object] = dict(
        model=str(model_path),
        model_weights="",
        revision=None,
        dtype="torch.bfloat16",
        quantization=None,
        hf_overrides={},
        get_total_num_kv_heads=lambda: 8,
        get_head_size=lambda: 128,
    )
    draft = changes.pop("draft", None)
    load_format = changes.pop("load_format", "auto")
    settings.update(changes)
    return SimpleNamespace(
        model_config=SimpleNamespace(**settings),
        load_config=SimpleNamespace(download_dir=None, load_format=load_format),
        speculative_config=None if draft is None else SimpleNamespace(draft_model_config=draft),
    )


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_model(tmp_path / "model")


def test_namespace_from_the_engine_config(model: Path) -> None:
    layout = namespace_layout(offloading_config(), vllm_config(model), blocks_per_chunk=4)
    assert layout == Layout(
        model=model_identity(str(model)),
        model_dtype="bfloat16",
        model_options='{"hf_overrides":null,"load_format":"auto","quantization":null}',
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
    assert layout.model.startswith("sha256:") and str(model) not in layout.canonical_json().decode()


def test_namespace_separates_what_makes_kv_differ(model: Path, tmp_path: Path) -> None:
    def namespace(
        config: SimpleNamespace | None = None, blocks: int = 1, **changes: object
    ) -> bytes:
        offloading = offloading_config() if config is None else config
        return namespace_layout(offloading, vllm_config(model, **changes), blocks).namespace()

    base = namespace()
    others = [
        namespace(blocks=2),
        namespace(config=offloading_config(parallel=SimpleNamespace(tp_size=4, pp_size=1))),
        namespace(config=offloading_config(model=SimpleNamespace(name="x", dtype="fp8"))),
        namespace(dtype="torch.float16"),
        namespace(quantization="fp8"),
        namespace(load_format="dummy"),
        namespace(hf_overrides={"rope_scaling": {"type": "yarn", "factor": 4.0}}),
        namespace(get_total_num_kv_heads=lambda: 4),
        namespace(
            draft=SimpleNamespace(model=str(write_model(tmp_path / "draft", 7)), revision=None)
        ),
        namespace(model=str(write_model(tmp_path / "other", seed=1))),
    ]
    assert len({base, *others}) == len(others) + 1
    # What vLLM calls the model does not matter, only what it is.
    assert (
        namespace(config=offloading_config(model=SimpleNamespace(name="y", dtype="bfloat16")))
        == base
    )


def test_namespace_follows_the_model_not_its_path(model: Path, tmp_path: Path) -> None:
    def namespace(path: Path) -> bytes:
        return namespace_layout(offloading_config(), vllm_config(path), 1).namespace()

    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    assert namespace(copy) == namespace(model)
    before = namespace(model)
    write_model(model, seed=5)  # new weights of the same shape over the same path
    assert namespace(model) != before


def test_weights_streamed_from_object_storage_are_named_by_their_url(
    model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM then points `model` at a local folder of config files only (`model_weights` holds
    the URL): that folder's content would not tell two fine-tunes apart."""
    config = vllm_config(model, model_weights="s3://bucket/llama")
    layout = namespace_layout(offloading_config(), config, 1)
    assert layout.model == "name:s3://bucket/llama@" and "no local files" in caplog.text


def test_a_function_in_hf_overrides_is_named_stably(model: Path) -> None:
    layout = namespace_layout(offloading_config(), vllm_config(model, hf_overrides=write_model), 1)
    assert (
        json.loads(layout.model_options)["hf_overrides"] == "tests.helpers.model_files.write_model"
    )


def test_lasting_tiers_are_the_persistent_and_shared_ones(tmp_path: Path) -> None:
    config = parse_config(
        {
            "tiers": [
                {"name": "ram", "type": "memory"},
                {"name": "nvme", "type": "file", "path": str(tmp_path)},
                {"name": "redis", "type": "redis", "url": "redis://127.0.0.1:1/0"},
                {"name": "s3", "type": "s3", "bucket": "b"},
            ]
        }
    )
    assert lasting_tiers(config) == ["nvme", "redis", "s3"]
    assert lasting_tiers(parse_config({"tiers": [{"name": "ram", "type": "memory"}]})) == []
