"""Eviction policies, looked up by name.

Built in: `lru` and `arc`. A custom policy is registered with `register_policy("name", cls)` or
`register_policy("name", "package.module:Class")` (imported on first use), or declared in the
entry-point group `kvtier.policies` (`fifo = "mypackage.policies:FIFOPolicy"`), and is then
accepted wherever a policy name is (`primary.eviction` in the YAML, `kvtier replay --policy`).
"""

from __future__ import annotations

from tiering.plugins import Registry
from tiering.policies.arc import ARCPolicy
from tiering.policies.base import EvictionPolicy
from tiering.policies.lru import LRUPolicy

__all__ = [
    "POLICIES",
    "ARCPolicy",
    "EvictionPolicy",
    "LRUPolicy",
    "create_policy",
    "get_policy_class",
    "policy_names",
    "register_policy",
]

POLICIES: Registry[EvictionPolicy[object, object]] = Registry(
    "eviction policy",
    EvictionPolicy,
    "kvtier.policies",
    {"lru": LRUPolicy, "arc": ARCPolicy},
)
"""Every eviction policy."""


def register_policy(
    name: str, policy: type[EvictionPolicy[object, object]] | str, *, replace: bool = False
) -> None:
    """Register an eviction policy class, or a lazy `"module:Class"` path, under a name."""
    POLICIES.register(name, policy, replace=replace)


def policy_names() -> list[str]:
    """Names of every known policy, sorted."""
    return POLICIES.names()


def get_policy_class(name: str) -> type[EvictionPolicy[object, object]]:
    """The policy class known as `name`; imports a lazily registered one."""
    return POLICIES.get(name)


def create_policy(name: str, capacity: int) -> EvictionPolicy[object, object]:
    """A new instance of the named policy for a cache of `capacity` keys."""
    return get_policy_class(name)(capacity)
