"""Placement policies: which blocks a tier admits, and whether a tier's hit is promoted.

`base` holds the contracts, `admission` and `gates` the built-in policies, `registry` the
names a YAML file uses (`promotion.gate: auto`).
"""

from tiering.placement.admission import AdmitAll, MinAge, MinHits, default_admission
from tiering.placement.base import AdmissionPolicy, BlockHistory, PromotionGate, TierFigures
from tiering.placement.gates import AlwaysGate, AutoGate, NeverGate
from tiering.placement.registry import (
    admission_class,
    admission_names,
    gate_class,
    gate_names,
    register_admission,
    register_gate,
)

__all__ = [
    "AdmissionPolicy",
    "AdmitAll",
    "AlwaysGate",
    "AutoGate",
    "BlockHistory",
    "MinAge",
    "MinHits",
    "NeverGate",
    "PromotionGate",
    "TierFigures",
    "admission_class",
    "admission_names",
    "default_admission",
    "gate_class",
    "gate_names",
    "register_admission",
    "register_gate",
]
