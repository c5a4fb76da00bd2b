"""Secondary tier types by name, and a tier built by type name from its options.

Built in: `memory`, `file`, `redis`, `s3`. Third-party tiers register in the entry-point group
`kvtier.tiers` (`mytier = "mypackage.tiers:MyTier"`) or at run time with `register_tier`
(`tiering.plugins.Registry`). A tier class that picks a concrete class from its options (the
file tier's `layout`) is asked which (`variant(options)`) before its options are read.
The registry knows tier classes, not the configuration: the configuration reads its tiers'
options through it, and builds the tier of a YAML entry with `create_tier`
(`tiering.config.tier_from_config`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tiering.errors import ConfigError
from tiering.plugins import Registry
from tiering.tier import Tier

__all__ = [
    "TIERS",
    "builtin_tier_types",
    "create_tier",
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


def get_tier_class(name: str, options: Mapping[str, Any] | None = None) -> type[Tier]:
    """The class of tier type `name` (given `options`, the variant they select: see
    `Tier.variant`); errors say what is unknown or what to install."""
    cls = TIERS.get(name)
    if options is None:
        return cls
    return cls.variant(options)


_NOT_OPTIONS = ("name", "secret")
"""Constructor arguments that are not options (`Tier.Options`): the tier's name and secret."""


def create_tier(type_name: str, *, namespace: bytes, **options: Any) -> Tier:
    """A tier of `type_name` built with `options` (its constructor's keyword arguments: the
    fields of its `Options` record, `name` and `secret`)."""
    given = {k: v for k, v in options.items() if k not in _NOT_OPTIONS}
    cls = get_tier_class(type_name, given)
    try:
        return cls(namespace=namespace, **options)
    except ConfigError as e:
        raise ConfigError(f"tier type {type_name!r}: {e}") from e
    except TypeError as e:
        raise ConfigError(f"tier type {type_name!r}: {e}") from e
