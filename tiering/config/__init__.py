"""The kvtier YAML configuration, loaded into frozen dataclasses.

    version: 1
    primary:   {capacity: 8GiB, eviction: arc, directory: /dev/shm}
    tiers:
      - {name: nvme,  type: file,  path: /mnt/nvme/kvtier, capacity: 500GiB, write: back}
      - {name: redis, type: redis, url: "redis://127.0.0.1:6379/0", password: "${REDIS_PASSWORD}",
         ttl: 1h, write: through}
      - {name: s3, type: s3, bucket: kv-cache, prefix: prod/, write: back, blocks_per_object: 8}
    promotion: {deadline: 200ms, gate: auto, prefill_rate: 20000}
    faults:    {timeout: 500ms, breaker: {failures: 5, cooldown: 10s, latency: 2s}}
    shutdown:  {flush: 10s, resident: true}
    metrics:   {prometheus_port: 9464, address: 127.0.0.1}
    auth:      {secret: "${KVTIER_SECRET}"}

One declaration per key (`schema`: the sections; each tier class's `Options` record: its own
options) produces the loader (`loader`), the defaults, the JSON Schema and the documentation
table (`generate`). Sizes and durations are read by `tiering.units`.
"""

from tiering.config.generate import json_schema, markdown_table, write_json_schema
from tiering.config.loader import load_config, parse_config
from tiering.config.schema import (
    SCHEMA_VERSION,
    AuthConfig,
    BreakerConfig,
    Config,
    FaultsConfig,
    MetricsConfig,
    PrimaryConfig,
    PromotionConfig,
    ShutdownConfig,
    TierConfig,
    TraceConfig,
)
from tiering.config.tiers import tier_from_config

__all__ = [
    "SCHEMA_VERSION",
    "AuthConfig",
    "BreakerConfig",
    "Config",
    "FaultsConfig",
    "MetricsConfig",
    "PrimaryConfig",
    "PromotionConfig",
    "ShutdownConfig",
    "TraceConfig",
    "TierConfig",
    "json_schema",
    "load_config",
    "markdown_table",
    "parse_config",
    "tier_from_config",
    "write_json_schema",
]
