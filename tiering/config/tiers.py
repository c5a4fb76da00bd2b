"""A tier type's own options, as the configuration reads and documents them, and the tier of a
configuration entry (`tier_from_config`).

A tier class declares them in its `Options` record (`tiering.tier.options.TierOptions`); a class
that picks a concrete class from its options (`variant`, e.g. the file tier's `layout`) is
asked first, so each variant accepts only its own. The keys of `TierConfig` (`capacity`
among them, though every record has it) are read by the configuration itself. The
configuration finds tier classes in the registry (`tiering.registry`), which knows nothing of
the configuration.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tiering.config.schema import Config, TierConfig
from tiering.errors import ConfigError
from tiering.registry import get_tier_class
from tiering.tier import Tier
from tiering.tier.options import Field, fields_of

__all__ = [
    "TIER_KEYS",
    "option_fields",
    "required",
    "tier_class",
    "tier_from_config",
    "variant_of",
    "variants",
]

TIER_KEYS = frozenset(fields_of(TierConfig))
"""The keys of a tier's mapping that are `TierConfig`'s own, not its class's options."""


def variant_of(cls: type[Tier], options: Mapping[str, Any]) -> type[Tier]:
    """The class that `options` select (`cls.variant(options)`: `cls` itself unless it chooses
    a concrete class by an option, as the file tier's `layout`)."""
    return cls.variant(options)


def tier_class(type_name: str, options: Mapping[str, Any], where: str) -> type[Tier]:
    """The class of tier type `type_name` that `options` (as written) select; a `ConfigError`
    names `where.type` (an unknown type) or `where.<option>` (an option `variant` refused)."""
    try:
        cls = get_tier_class(type_name)
    except ConfigError as e:
        raise ConfigError(f"{where}.type: {e}") from None
    try:
        return variant_of(cls, options)
    except ConfigError as e:
        raise ConfigError(f"{where}.{e}") from None


def option_fields(cls: type[Tier]) -> dict[str, Field]:
    """How each option of tier class `cls` is read (its `Options` record's fields), less the
    keys of `TierConfig`."""
    return {name: f for name, f in fields_of(cls.Options).items() if name not in TIER_KEYS}


def variants(cls: type[Tier]) -> list[tuple[type[Tier], str, tuple[str, ...]]]:
    """The classes tier class `cls` can become, each with the choice option that selects it and
    that option's values selecting it: `[(cls.variant({}), "", ())]` when no option does. The
    default one (selected by `{}`) comes first. Found by asking `variant` for every value of
    every choice option."""
    default = variant_of(cls, {})
    choices = {name: f.names() for name, f in option_fields(cls).items() if f.kind == "choice"}
    for name, values in choices.items():
        picked: dict[type[Tier], list[str]] = {}
        for value in values:
            picked.setdefault(variant_of(cls, {name: value}), []).append(value)
        if len(picked) > 1:
            found = sorted(picked.items(), key=lambda item: item[0] is not default)
            return [(klass, name, tuple(chosen)) for klass, chosen in found]
    return [(default, "", ())]


def required(fields: Mapping[str, Field]) -> list[str]:
    """The names of the options that have no default, sorted."""
    return sorted(name for name, f in fields.items() if f.required)


def tier_from_config(
    entry: TierConfig,
    namespace: bytes,
    config: Config,
    *,
    default_timeout: float | None = None,
    **overrides: Any,
) -> Tier:
    """The tier of `entry` (one of `config.tiers`) in `namespace`, with the deployment's secret
    (`auth.secret`): the one way from a YAML entry to a tier, built with the options record the
    loader checked (`TierConfig.record`). Its deadline is the entry's `timeout` option, else
    `default_timeout`, else `faults.timeout`; `overrides` (`read_only=True`, a `timeout`,
    scratch options) win over the entry's options."""
    default = config.faults.timeout if default_timeout is None else default_timeout
    values = {} if "timeout" in entry.options else {"timeout": default}
    try:
        cls = variant_of(get_tier_class(entry.type), entry.options)
        record = entry.record
        if record is None:  # an entry built in code, not loaded: its options read here
            record = cls.Options.of({**entry.options, "capacity": entry.capacity})
        return cls(
            namespace=namespace,
            name=entry.name,
            secret=config.auth.secret,
            encrypt=config.auth.encrypt,
            options=record,
            **{**values, **overrides},
        )
    except (ConfigError, TypeError) as e:  # (an override: the entry was checked at load)
        raise ConfigError(f"tier {entry.name!r} ({entry.type}): {e}") from e
