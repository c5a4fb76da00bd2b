"""Placement policies by name: promotion gates and admission policies.

Built in, gates: `auto`, `always`, `never`; admission: `all`, `min-hits`, `min-age`. A third
party registers a class at run time (`register_gate`, `register_admission`), or lazily in the
entry-point groups `kvtier.placement.gates` and `kvtier.placement.admission`
(`mygate = "mypackage.gates:MyGate"`); a `"package.module:Class"` path is accepted wherever a
name is, as vLLM's offloading factories accept a module path (`tiering.plugins.Registry`).
Names are looked up when the manager is built, never on the step path.
"""

from __future__ import annotations

from tiering.placement.base import AdmissionPolicy, PromotionGate
from tiering.plugins import Registry

__all__ = [
    "ADMISSION_NAMES",
    "GATE_NAMES",
    "admission_class",
    "admission_names",
    "gate_class",
    "gate_names",
    "register_admission",
    "register_gate",
]

GATE_NAMES: Registry[PromotionGate] = Registry(
    "promotion gate",
    PromotionGate,
    "kvtier.placement.gates",
    {
        "auto": "tiering.placement.gates:AutoGate",
        "always": "tiering.placement.gates:AlwaysGate",
        "never": "tiering.placement.gates:NeverGate",
    },
    sort=False,
    paths=True,
)
"""Every promotion gate, for `promotion.gate` (iterating it lists their names afresh)."""
ADMISSION_NAMES: Registry[AdmissionPolicy] = Registry(
    "admission policy",
    AdmissionPolicy,
    "kvtier.placement.admission",
    {
        "all": "tiering.placement.admission:AdmitAll",
        "min-hits": "tiering.placement.admission:MinHits",
        "min-age": "tiering.placement.admission:MinAge",
    },
    sort=False,
    paths=True,
)
"""Every admission policy, for `tiers[].admission`."""


def register_gate(name: str, gate: type[PromotionGate] | str, *, replace: bool = False) -> None:
    """Register a promotion gate class, or a lazy `"package.module:Class"` path, by name."""
    GATE_NAMES.register(name, gate, replace=replace)


def register_admission(
    name: str, policy: type[AdmissionPolicy] | str, *, replace: bool = False
) -> None:
    """Register an admission policy class, or a lazy `"package.module:Class"` path, by name."""
    ADMISSION_NAMES.register(name, policy, replace=replace)


def gate_names() -> list[str]:
    """Every known gate name: built in and registered, then from entry points."""
    return GATE_NAMES.names()


def admission_names() -> list[str]:
    """Every known admission policy name: built in and registered, then from entry points."""
    return ADMISSION_NAMES.names()


def gate_class(name: str) -> type[PromotionGate]:
    """The gate class of `name` (a registered name or a `"module:Class"` path)."""
    return GATE_NAMES.get(name)


def admission_class(name: str) -> type[AdmissionPolicy]:
    """The admission policy class of `name` (a registered name or a `"module:Class"` path)."""
    return ADMISSION_NAMES.get(name)
