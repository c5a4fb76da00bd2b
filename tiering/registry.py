"""Secondary tier types by name: their classes.

Built in: `memory`, `file`, `redis`, `s3`. Third-party tiers register in the entry-point group
`kvtier.tiers` (`mytier = "mypackage.tiers:MyTier"`) or at run time with `register_tier`
(`tiering.plugins.Registry`). The registry knows tier classes, not the configuration: the
configuration finds a type's class here, asks it which concrete class its options select (the
file tier's `layout`: `Tier.variant`), and builds the tier of a YAML entry
(`tiering.config.tier_from_config`, the one way from an entry to a tier).
"""

from __future__ import annotations

from tiering.plugins import Registry
from tiering.tier import Tier

__all__ = [
    "TIERS",
    "builtin_tier_types",
    "get_tier_class",
    "register_tier",
    "tier_types",
]

TIERS: Registry[Tier] = Registry(
    "tier type",
    Tier,
    "kvtier.tiers",
    {
        "memory": "tiers.memory:MemoryTier",
        "file": "tiers.file:FileTier",
        "redis": "tiers.redis:RedisTier",
        "s3": "tiers.s3:S3Tier",
    },
    extras={"redis": "redis", "s3": "s3"},  # the extra that brings the type's dependencies
)
"""Every tier type."""


def register_tier(name: str, tier: str | type[Tier], *, replace: bool = False) -> None:
    """Register a tier class, or a lazy `"package.module:Class"` path, under a type name."""
    TIERS.register(name, tier, replace=replace)


def tier_types() -> list[str]:
    return TIERS.names()


def builtin_tier_types() -> list[str]:
    """The tier types kvtier itself brings (those the JSON Schema and the docs describe)."""
    return TIERS.builtin()


def get_tier_class(name: str) -> type[Tier]:
    """The class of tier type `name` (before a variant is chosen: `tiering.config.tier_class`);
    errors say what is unknown or what to install."""
    return TIERS.get(name)
