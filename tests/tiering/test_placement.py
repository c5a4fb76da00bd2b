"""Placement policies alone: the built-in gates and admission policies, and the registry that
names them for the YAML."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.tiers.memory_hooks import plant
from tiering.config import TierConfig
from tiering.errors import ConfigError, UnknownNameError
from tiering.keys import BlockKey, make_key
from tiering.placement import (
    AdmissionPolicy,
    AdmitAll,
    AlwaysGate,
    AutoGate,
    BlockHistory,
    MinAge,
    MinHits,
    NeverGate,
    PromotionGate,
    TierFigures,
    admission_class,
    admission_names,
    default_admission,
    gate_class,
    gate_names,
    register_admission,
    register_gate,
    registry,
)


def k(i: int) -> BlockKey:
    return make_key(i.to_bytes(32, "big"))


@dataclass
class Figures:
    name: str = "t"
    seconds_per_block: float | None = None


def gate(cls: type[PromotionGate]) -> PromotionGate:
    return cls(block_tokens=32, prefill_rate=32_000.0)  # recomputing a block: 1 ms


def test_the_auto_gate_tries_first_then_promotes_only_what_beats_recomputing() -> None:
    auto = gate(AutoGate)
    assert auto.allows(Figures(seconds_per_block=None))  # nothing measured: try, and learn
    assert auto.allows(Figures(seconds_per_block=0.0009))
    assert not auto.allows(Figures(seconds_per_block=0.001))


def test_always_and_never() -> None:
    assert gate(AlwaysGate).always_open and gate(AlwaysGate).allows(Figures(seconds_per_block=9))
    assert not gate(NeverGate).always_open and not gate(NeverGate).allows(Figures())


def test_admission_by_hits_and_age() -> None:
    blocks = [(k(i), i) for i in range(4)]
    history = BlockHistory(tracks_hits=True, tracks_age=True)
    history.loaded([k(1), k(2), k(2)])
    history.stored([k(0), k(1), k(2)], now=100.0)  # k(3): never counted, taken as stored now
    selective = TierConfig(name="t", type="memory", write="selective", admit_after_hits=2)
    assert MinHits(selective).admit(blocks, history, 200.0) == [(k(2), 2)]
    aged = TierConfig(name="t", type="memory", min_age=50.0)
    assert MinAge(aged).admit(blocks, history, 160.0) == [(k(0), 0), (k(1), 1), (k(2), 2)]
    assert MinAge(aged).admit(blocks, history, 140.0) == []
    assert AdmitAll(aged).admit(blocks, history, 0.0) == blocks
    history.forget([k(2)])
    assert MinHits(selective).admit(blocks, history, 200.0) == []


def test_a_tiers_configuration_implies_its_admission_in_order() -> None:
    assert default_admission(TierConfig(name="t", type="memory", write="back")) == ()
    policies = default_admission(
        TierConfig(name="t", type="memory", write="selective", min_age=1.0)
    )
    assert [type(p) for p in policies] == [MinHits, MinAge]
    assert [type(p) for p in default_admission(TierConfig(name="t", type="m", min_age=1.0))] == [
        MinAge
    ]


def test_the_registry_knows_todays_names() -> None:
    assert {"auto", "always", "never"} <= set(gate_names())
    assert {"all", "min-hits", "min-age"} <= set(admission_names())
    assert gate_class("auto") is AutoGate and admission_class("min-hits") is MinHits
    assert gate_class("tiering.placement.gates:NeverGate") is NeverGate  # a module path


def test_unknown_names_say_what_is_known() -> None:
    with pytest.raises(
        UnknownNameError,
        match=r"unknown promotion gate 'alway' \(did you mean 'always'\?\); "
        "known: auto, always, never",
    ):
        gate_class("alway")
    with pytest.raises(ConfigError, match="is not a PromotionGate subclass"):
        gate_class("tiering.placement.admission:MinHits")
    with pytest.raises(ConfigError, match="cannot import"):
        admission_class("no.such.module:Policy")


class Halfway(PromotionGate):
    """A third-party gate: promote from tiers named 'near' only."""

    def allows(self, tier: TierFigures) -> bool:
        return tier.name == "near"


class Nothing(AdmissionPolicy):
    def admit(
        self, blocks: object, history: BlockHistory, now: float
    ) -> list[tuple[BlockKey, int]]:
        return []


@pytest.fixture
def restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registries as they were, after the test."""
    for names in (registry.GATE_NAMES, registry.ADMISSION_NAMES):
        monkeypatch.setattr(names, "_table", dict(names._table))


def test_a_registered_policy_is_known_by_name(restored: None) -> None:
    register_gate("halfway", Halfway)
    register_admission("nothing", f"{__name__}:Nothing")  # lazy: imported on first use
    assert gate_class("halfway") is Halfway and "halfway" in gate_names()
    assert admission_class("nothing") is Nothing
    with pytest.raises(ConfigError, match="already registered"):
        register_gate("auto", Halfway)
    register_gate("auto", Halfway, replace=True)
    assert gate_class("auto") is Halfway
    with pytest.raises(ConfigError, match="must be lowercase"):
        register_gate("Bad Name", Halfway)
    with pytest.raises(ConfigError, match="is not a PromotionGate subclass"):
        register_gate("wrong", Nothing)  # type: ignore[arg-type]


def test_the_config_takes_any_gate_the_registry_knows(restored: None) -> None:
    from tiering.config import parse_config

    assert parse_config({"promotion": {"gate": "never"}}).promotion.gate == "never"
    with pytest.raises(ConfigError, match="promotion.gate: expected one of auto, always, never"):
        parse_config({"promotion": {"gate": "halfway"}})
    register_gate("halfway", Halfway)
    assert parse_config({"promotion": {"gate": "halfway"}}).promotion.gate == "halfway"


def test_the_manager_uses_the_gate_the_config_names(restored: None) -> None:
    import numpy as np

    from tiering.config import parse_config
    from tiering.manager import TieringOffloadingManager, close_tiers
    from tiering.primary import LookupResult, PrimaryPool
    from tiering.runtime import Runtime
    from tiering.testing import NAMESPACE
    from tiers.memory import MemoryTier

    register_gate("halfway", Halfway)
    config = parse_config(
        {"promotion": {"gate": "halfway"}, "tiers": [{"name": "far", "type": "memory"}]}
    )
    tier = MemoryTier(namespace=NAMESPACE, name="far")
    memory = np.zeros((4, 64), dtype=np.uint8)
    manager = TieringOffloadingManager(
        PrimaryPool(4, "lru"),
        [(config.tiers[0], tier)],
        lambda s: memoryview(memory[s]),
        config=config,
        runtime=(runtime := Runtime()),
        block_tokens=16,
    )
    try:
        assert isinstance(manager.promoter.gate, Halfway)
        plant(tier, k(1), tier._encode(k(1), bytes(64))[1][0] + bytes(64))
        assert manager.lookup(k(1)) is LookupResult.MISS  # 'far' is not 'near': gated
        manager.on_schedule_end()
        assert manager.tiers[0].counters["gated"] == 1
    finally:
        manager.shutdown()
        close_tiers(runtime, [(config.tiers[0], tier)])
        runtime.shutdown()


def test_a_tier_takes_any_admission_policy_the_registry_knows(restored: None) -> None:
    from tiering.config import parse_config
    from tiering.manager.tierstate import TierState
    from tiering.testing import NAMESPACE
    from tiers.memory import MemoryTier

    def policies(tier: dict[str, object]) -> list[type]:
        (cfg,) = parse_config({"tiers": [{"name": "t", "type": "memory", **tier}]}).tiers
        state = TierState.of(cfg, MemoryTier(namespace=NAMESPACE, name="t"), 0)
        return [type(p) for p in state.admission]

    assert policies({"write": "selective", "min_age": "1s"}) == [MinHits, MinAge]  # implied
    assert policies({"write": "selective", "admission": "all"}) == [AdmitAll]  # named instead
    assert policies({"admission": "min-hits"}) == [MinHits]
    with pytest.raises(ConfigError, match=r"tiers\[0\].admission: expected one of all, min-h"):
        policies({"admission": "nothing"})
    register_admission("nothing", Nothing)
    assert policies({"admission": "nothing"}) == [Nothing]
