"""Eviction policies, looked up by name.

Built in: `lru` and `arc`. A custom policy is registered with `register_policy("name", cls)` or
`register_policy("name", "package.module:Class")` (imported on first use), and is then accepted
wherever a policy name is (`primary.eviction` in the YAML, `kvtier replay --policy`).
"""

from __future__ import annotations

import difflib
import importlib
import re

from tiering.errors import ConfigError, UnknownNameError
from tiering.policies.arc import ARCPolicy, PythonARCPolicy
from tiering.policies.base import EvictionPolicy
from tiering.policies.lru import LRUPolicy

__all__ = [
    "ARCPolicy",
    "EvictionPolicy",
    "LRUPolicy",
    "PythonARCPolicy",
    "create_policy",
    "get_policy_class",
    "policy_names",
    "register_policy",
]

_NAME = re.compile(r"[a-z][a-z0-9_-]*\Z")
_registry: dict[str, type[EvictionPolicy[object, object]] | str] = {
    "lru": LRUPolicy,
    "arc": ARCPolicy,
}


def register_policy(
    name: str, policy: type[EvictionPolicy[object, object]] | str, *, replace: bool = False
) -> None:
    """Register an eviction policy class, or a lazy `"module:Class"` path, under a name."""
    if not _NAME.match(name):
        raise ConfigError(
            f"policy name {name!r} must be lowercase letters, digits, '-' or '_', "
            "starting with a letter"
        )
    if isinstance(policy, str):
        if policy.count(":") != 1:
            raise ConfigError(f"policy {name!r}: expected 'package.module:Class', got {policy!r}")
    elif not (isinstance(policy, type) and issubclass(policy, EvictionPolicy)):
        raise ConfigError(f"policy {name!r}: {policy!r} is not an EvictionPolicy subclass")
    if name in _registry and not replace:
        raise ConfigError(f"eviction policy {name!r} is already registered (pass replace=True)")
    _registry[name] = policy


def policy_names() -> list[str]:
    """Names of every registered policy, sorted."""
    return sorted(_registry)


def get_policy_class(name: str) -> type[EvictionPolicy[object, object]]:
    """The policy class registered under `name`; imports a lazily registered one."""
    try:
        entry = _registry[name]
    except KeyError:
        known = ", ".join(policy_names())
        close = difflib.get_close_matches(name, _registry, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UnknownNameError(f"unknown eviction policy {name!r}{hint}; known: {known}") from None
    if isinstance(entry, str):
        module_name, _, class_name = entry.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"eviction policy {name!r}: cannot import {entry!r}: {e}") from e
        if not (isinstance(cls, type) and issubclass(cls, EvictionPolicy)):
            raise ConfigError(f"eviction policy {name!r}: {entry!r} is not an EvictionPolicy")
        _registry[name] = entry = cls
    return entry


def create_policy(name: str, capacity: int) -> EvictionPolicy[object, object]:
    """A new instance of the named policy for a cache of `capacity` keys."""
    return get_policy_class(name)(capacity)
