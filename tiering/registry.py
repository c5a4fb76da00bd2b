"""Secondary tier types by name, imported lazily.

Built in: `memory`, `file`, `redis`, `s3`. Third-party tiers register in the entry-point group
`kvtier.tiers` (`mytier = "mypackage.tiers:MyTier"`) or at run time with `register_tier`. A tier
class that picks a concrete class from its options (the file tier's `layout`) is asked which
(`variant(options)`) before its options are read.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import typing
from collections.abc import Mapping
from typing import Any

from tiering.errors import ConfigError, MissingDependencyError, UnknownNameError
from tiering.options import fields_of
from tiering.tier import Tier

__all__ = ["builtin_tier_types", "create_tier", "get_tier_class", "register_tier", "tier_types"]

ENTRY_POINT_GROUP = "kvtier.tiers"

# type -> (import path, the extra that brings its dependencies)
_BUILTIN: dict[str, tuple[str, str | None]] = {
    "memory": ("tiers.memory:MemoryTier", None),
    "file": ("tiers.file:FileTier", None),
    "redis": ("tiers.redis:RedisTier", "redis"),
    "s3": ("tiers.s3:S3Tier", "s3"),
}
_registered: dict[str, str | type[Tier]] = {}


def register_tier(name: str, tier: str | type[Tier], *, replace: bool = False) -> None:
    """Register a tier class, or a lazy `"package.module:Class"` path, under a type name."""
    if name in tier_types() and not replace:
        raise ConfigError(f"tier type {name!r} is already registered (pass replace=True)")
    _registered[name] = tier


def _entry_points() -> dict[str, str]:
    return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def tier_types() -> list[str]:
    return sorted({*_BUILTIN, *_entry_points(), *_registered})


def builtin_tier_types() -> list[str]:
    """The tier types kvtier itself brings (those the JSON Schema and the docs describe)."""
    return sorted(_BUILTIN)


def get_tier_class(name: str, options: Mapping[str, Any] | None = None) -> type[Tier]:
    """The class of tier type `name` (given `options`, the variant they select: see
    `Tier.variant`); errors say what is unknown or what to install."""
    cls = _tier_class(name)
    if options is None:
        return cls
    choose = getattr(cls, "variant", None)
    return cls if choose is None else typing.cast(type[Tier], choose(options))


def _tier_class(name: str) -> type[Tier]:
    extra = None
    if name in _registered:
        target: str | type[Tier] = _registered[name]
    elif name in _BUILTIN:
        target, extra = _BUILTIN[name]
    else:
        found = _entry_points().get(name)
        if found is None:
            close = difflib.get_close_matches(name, tier_types(), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UnknownNameError(
                f"unknown tier type {name!r}{hint}; known: {', '.join(tier_types())}"
            )
        target = found
    if not isinstance(target, str):
        return target
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        if extra is not None:
            package = (e.name or extra).split(".")[0]
            raise MissingDependencyError(
                f"tier type {name!r} needs the {package} package: pip install kvtier[{extra}]"
            ) from e
        raise MissingDependencyError(f"tier type {name!r}: cannot import {target!r}: {e}") from e
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Tier)):
        raise ConfigError(f"tier type {name!r}: {target!r} is not a Tier subclass")
    return cls


_NOT_OPTIONS = ("name", "secret")
"""Constructor arguments that are not options (`Tier.Options`): the tier's name and secret."""


def create_tier(type_name: str, *, namespace: bytes, **options: Any) -> Tier:
    """A tier of `type_name` built with `options` (its constructor's keyword arguments: the
    fields of its `Options` record, `name` and `secret`)."""
    given = {k: v for k, v in options.items() if k not in _NOT_OPTIONS}
    cls = get_tier_class(type_name, given)
    record = getattr(cls, "Options", None)
    if record is not None:
        known = fields_of(record)
        for key in given:
            if key not in known:
                raise ConfigError(
                    f"tier type {type_name!r}: unexpected keyword argument {key!r}; "
                    f"its options: {', '.join(known)}"
                )
    try:
        return cls(namespace=namespace, **options)
    except TypeError as e:
        raise ConfigError(f"tier type {type_name!r}: {e}") from e
