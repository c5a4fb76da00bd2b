"""Start-up checks of the vLLM connector, kept free of vLLM imports so they are unit-tested in
kvtier's own environment. Each fails with a `ConfigError` that says what to change."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from connectors.identity import model_identity
from tiering.config import Config, load_config, parse_config
from tiering.errors import ConfigError
from tiering.keys import Layout
from tiering.registry import get_tier_class
from tiering.units import parse_size

__all__ = [
    "UNSTABLE_HASHES",
    "check_block_hashing",
    "lasting_tiers",
    "namespace_layout",
    "primary_capacity",
    "read_config",
]

UNSTABLE_HASHES = frozenset({"xxhash", "xxhash_cbor"})


def check_block_hashing(hash_algo: str, hash_seed: str | None, lasting_tiers: list[str]) -> None:
    """Blocks in a persistent or shared tier are found again only if block hashes are the same
    in every process and after restarts; vLLM seeds its non-cryptographic hashes randomly per
    process unless PYTHONHASHSEED is set."""
    if lasting_tiers and hash_algo in UNSTABLE_HASHES and hash_seed is None:
        raise ConfigError(
            f"tiers {', '.join(lasting_tiers)} keep blocks across processes, but vLLM's "
            f"prefix_caching_hash_algo '{hash_algo}' is seeded randomly per process: set "
            "--prefix-caching-hash-algo sha256 (the default), or PYTHONHASHSEED to the same "
            "value in every vLLM process"
        )


def read_config(extra: Mapping[str, Any]) -> Config:
    """The kvtier configuration from vLLM's `kv_connector_extra_config`."""
    path, inline = extra.get("config"), extra.get("kvtier")
    if path is not None and inline is not None:
        raise ConfigError(
            "kv_connector_extra_config: give either 'config' (a YAML path) or 'kvtier' "
            "(the same structure inline), not both"
        )
    if path is not None:
        if not isinstance(path, str | os.PathLike):
            raise ConfigError(f"kv_connector_extra_config.config: expected a path, got {path!r}")
        return load_config(os.fspath(path))
    if inline is not None:
        try:
            return parse_config(inline)
        except ConfigError as e:
            raise ConfigError(f"kv_connector_extra_config.kvtier: {e}") from None
    return parse_config({})


def primary_capacity(config: Config, extra: Mapping[str, Any]) -> int:
    """The primary's capacity in bytes: `primary.capacity`, else vLLM's `cpu_bytes_to_use`
    from `kv_connector_extra_config` (`extra`), which `primary.warm_start` must not exceed
    either (the loader checks it against `primary.capacity`)."""
    capacity = config.primary.capacity
    if capacity is not None:
        return capacity
    if "cpu_bytes_to_use" not in extra:
        raise ConfigError(
            "kvtier needs a primary capacity: set primary.capacity in the kvtier config "
            "or cpu_bytes_to_use in kv_connector_extra_config"
        )
    capacity = parse_size(extra["cpu_bytes_to_use"], "cpu_bytes_to_use")
    config.primary.check_warm_start(capacity, "cpu_bytes_to_use")
    return capacity


def lasting_tiers(config: Config) -> list[str]:
    """Names of the configured tiers whose blocks outlive the process or are seen by other
    processes (their class declares `persistent` or `shared`), found without building them."""
    return [
        tier.name
        for tier in config.tiers
        if get_tier_class(tier.type).persistent or get_tier_class(tier.type).shared
    ]


def namespace_layout(config: Any, vllm_config: Any, blocks_per_chunk: int) -> Layout:
    """The namespace facts of an engine, from vLLM's `OffloadingConfig` (`config`) and the
    `VllmConfig` the engine was built with. Both roles compute it from what vLLM hands them, so
    the scheduler's namespace (the one stored in objects) is the workers' one."""
    model = vllm_config.model_config
    layers = sum(len(group.layer_names) for group in config.groups)
    return Layout(
        model=model_identity(
            model.model_weights or model.model,  # weights streamed from object storage: a URL
            model.revision,
            download_dir=vllm_config.load_config.download_dir,
        ),
        model_dtype=str(model.dtype),
        model_options=_model_options(vllm_config),
        dtype=config.model.dtype,
        kv_layout=config.kv_cache_layout or "LBHNC",
        page_size_bytes=config.worker_kv_bytes_per_block,
        tokens_per_block=config.groups[0].tokens_per_block * blocks_per_chunk,
        num_layers=max(layers, 1),
        num_kv_heads=model.get_total_num_kv_heads(),
        head_size=model.get_head_size(),
        tp_size=config.parallel.tp_size,
        pp_size=config.parallel.pp_size,
    )


def _model_options(vllm_config: Any) -> str:
    """The engine settings besides the weights that change a model's KV, as canonical JSON."""
    model = vllm_config.model_config
    options: dict[str, Any] = {
        "quantization": model.quantization,
        "hf_overrides": model.hf_overrides or None,
        "load_format": str(vllm_config.load_config.load_format),  # `dummy`: random weights
    }
    speculative = vllm_config.speculative_config
    draft = None if speculative is None else speculative.draft_model_config
    if draft is not None:
        options["draft"] = model_identity(draft.model, draft.revision)
    return json.dumps(options, sort_keys=True, separators=(",", ":"), default=_jsonable)


def _jsonable(value: Any) -> str:
    """A stable text for what JSON cannot hold: a function by its qualified name (its repr
    carries an address, different in every process), anything else by `str`."""
    if callable(value):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', value)}"
    return str(value)
