"""Placement policies by name: promotion gates and admission policies.

Built in, gates: `auto`, `always`, `never`; admission: `all`, `min-hits`, `min-age`. A third
party registers a class at run time (`register_gate`, `register_admission`), or lazily in the
entry-point groups `kvtier.placement.gates` and `kvtier.placement.admission`
(`mygate = "mypackage.gates:MyGate"`); a `"package.module:Class"` path is accepted wherever a
name is, as vLLM's offloading factories accept a module path. Names are looked up when the
manager is built, never on the step path.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import re
from collections.abc import Iterator
from typing import Any, TypeVar, cast

from tiering.errors import ConfigError, UnknownNameError
from tiering.placement.base import AdmissionPolicy, PromotionGate

__all__ = [
    "ADMISSION_GROUP",
    "ADMISSION_NAMES",
    "GATE_NAMES",
    "GATE_GROUP",
    "admission_class",
    "admission_names",
    "gate_class",
    "gate_names",
    "register_admission",
    "register_gate",
]

GATE_GROUP = "kvtier.placement.gates"
ADMISSION_GROUP = "kvtier.placement.admission"

_P = TypeVar("_P", AdmissionPolicy, PromotionGate)
_NAME = re.compile(r"[a-z][a-z0-9_-]*\Z")

_gates: dict[str, type[PromotionGate] | str] = {
    "auto": "tiering.placement.gates:AutoGate",
    "always": "tiering.placement.gates:AlwaysGate",
    "never": "tiering.placement.gates:NeverGate",
}
_admission: dict[str, type[AdmissionPolicy] | str] = {
    "all": "tiering.placement.admission:AdmitAll",
    "min-hits": "tiering.placement.admission:MinHits",
    "min-age": "tiering.placement.admission:MinAge",
}


def register_gate(name: str, gate: type[PromotionGate] | str, *, replace: bool = False) -> None:
    """Register a promotion gate class, or a lazy `"package.module:Class"` path, by name."""
    _register(_gates, GATE_GROUP, PromotionGate, "promotion gate", name, gate, replace)


def register_admission(
    name: str, policy: type[AdmissionPolicy] | str, *, replace: bool = False
) -> None:
    """Register an admission policy class, or a lazy `"package.module:Class"` path, by name."""
    _register(
        _admission, ADMISSION_GROUP, AdmissionPolicy, "admission policy", name, policy, replace
    )


def gate_names() -> list[str]:
    """Every known gate name: built in and registered, then from entry points."""
    return _names(_gates, GATE_GROUP)


def admission_names() -> list[str]:
    """Every known admission policy name: built in and registered, then from entry points."""
    return _names(_admission, ADMISSION_GROUP)


def gate_class(name: str) -> type[PromotionGate]:
    """The gate class of `name` (a registered name or a `"module:Class"` path)."""
    return _resolve(_gates, GATE_GROUP, PromotionGate, "promotion gate", name)


def admission_class(name: str) -> type[AdmissionPolicy]:
    """The admission policy class of `name` (a registered name or a `"module:Class"` path)."""
    return _resolve(_admission, ADMISSION_GROUP, AdmissionPolicy, "admission policy", name)


def _register(
    table: dict[str, type[_P] | str],
    group: str,
    base: type,
    what: str,
    name: str,
    target: type[_P] | str,
    replace: bool,
) -> None:
    if not _NAME.match(name):
        raise ConfigError(
            f"{what} name {name!r} must be lowercase letters, digits, '-' or '_', "
            "starting with a letter"
        )
    if isinstance(target, str):
        if target.count(":") != 1:
            raise ConfigError(f"{what} {name!r}: expected 'package.module:Class', got {target!r}")
    elif not (isinstance(target, type) and issubclass(target, base)):
        raise ConfigError(f"{what} {name!r}: {target!r} is not a {base.__name__} subclass")
    if name in _names(table, group) and not replace:
        raise ConfigError(f"{what} {name!r} is already registered (pass replace=True)")
    table[name] = target


def _entry_points(group: str) -> dict[str, str]:
    return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=group)}


def _names(table: dict[str, type[_P] | str], group: str) -> list[str]:
    """Built-in and registered names in registration order, then the entry points' sorted."""
    return [*table, *sorted(set(_entry_points(group)) - set(table))]


class _Names:
    """The names of a registry, read afresh each time it is iterated: what the configuration's
    `choice` options take (`"tiering.placement.registry:GATE_NAMES"`), so a gate registered
    before the YAML is read is accepted by name."""

    def __init__(self, table: dict[str, Any], group: str) -> None:
        self._table = table
        self._group = group

    def __iter__(self) -> Iterator[str]:
        return iter(_names(self._table, self._group))


GATE_NAMES = _Names(_gates, GATE_GROUP)
"""Every known gate name, for `promotion.gate`."""
ADMISSION_NAMES = _Names(_admission, ADMISSION_GROUP)
"""Every known admission policy name."""


def _resolve(
    table: dict[str, type[_P] | str], group: str, base: type, what: str, name: str
) -> type[_P]:
    target: type[_P] | str | None = table.get(name)
    if target is None and ":" in name:
        target = name
    if target is None:
        target = _entry_points(group).get(name)
    if target is None:
        known = _names(table, group)
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UnknownNameError(f"unknown {what} {name!r}{hint}; known: {', '.join(known)}")
    if not isinstance(target, str):
        return target
    module_name, _, class_name = target.partition(":")
    try:
        found: Any = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{what} {name!r}: cannot import {target!r}: {e}") from e
    if not (isinstance(found, type) and issubclass(found, base)):
        raise ConfigError(f"{what} {name!r}: {target!r} is not a {base.__name__} subclass")
    cls = cast("type[_P]", found)
    if name in table:
        table[name] = cls
    return cls
