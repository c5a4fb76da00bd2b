"""The secondary tiers as the manager holds them: each tier with its configuration, its
admission policies, its in-flight demotions and its figures; and how they are built."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from tiering.config import AuthConfig, Config, TierConfig, tier_from_config
from tiering.keys import BlockKey, store_namespace
from tiering.placement import AdmissionPolicy, admission_class, default_admission
from tiering.runtime import Runtime
from tiering.tier import Tier
from tiering.tier.rotation import RotatingTier

__all__ = ["TierEvent", "TierState", "build_tiers", "close_tiers"]


def build_tiers(config: Config, namespace: bytes) -> list[tuple[TierConfig, Tier]]:
    """The configured secondary tiers, in order (`tiering.config.tier_from_config`), holding
    the blocks of the layout `namespace` under the store namespace of the deployment's secret
    (`tiering.keys.store_namespace`)."""
    stored = store_namespace(namespace, config.auth.secret)
    return [(cfg, _rotating(cfg, namespace, stored, config)) for cfg in config.tiers]


def _rotating(cfg: TierConfig, namespace: bytes, stored: bytes, config: Config) -> Tier:
    """The tier of `cfg` in the current secret's names, reading through to each previous
    secret's (`auth.previous`: `RotatingTier`) during a rotation."""
    tier = tier_from_config(cfg, stored, config)
    if not config.auth.previous:
        return tier
    previous = [
        tier_from_config(
            cfg,
            store_namespace(namespace, old),
            dataclasses.replace(config, auth=AuthConfig(secret=old)),
            read_only=True,
        )
        for old in config.auth.previous
    ]
    return RotatingTier(tier, previous)


def close_tiers(
    runtime: Runtime, tiers: Sequence[tuple[TierConfig, Tier]], timeout: float = 5.0
) -> int:
    """Close `tiers` (what `build_tiers` opened) on `runtime`'s loop, each within `timeout`
    seconds, one's failure keeping none of the rest open; before the runtime is shut down,
    after the manager over them (`TieringOffloadingManager.shutdown`). How many failed."""
    failed = 0
    for _, tier in tiers:
        try:
            runtime.run_sync(tier.close, timeout)
        except Exception:  # one tier's failure must not keep the rest open
            failed += 1
    return failed


@dataclass(frozen=True, slots=True)
class TierEvent:
    """Any thread (a frozen value): keys that a secondary tier now holds (removed=False)."""

    tier: str
    keys: tuple[BlockKey, ...]
    removed: bool = False


@dataclass(eq=False)
class TierState:
    """One secondary tier in the manager. Scheduler process, under the step lock (scheduler or
    runtime thread)."""

    config: TierConfig
    tier: Tier
    index: int
    indexed: bool = False
    """The tier answers `knows` (existence checks only for the keys it answers None for)."""
    admission: tuple[AdmissionPolicy, ...] = ()
    """Applied in order to the blocks a write-back or selective demotion would take."""
    inflight: int = 0
    """Blocks being demoted to this tier."""
    seconds_per_block: float | None = None
    """Moving average of promotion time per block (what the `auto` gate reads)."""
    counters: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    latencies: list[float] = field(default_factory=list)
    """Job durations since the last `stats()`."""

    @classmethod
    def of(cls, config: TierConfig, tier: Tier, index: int) -> TierState:
        """The tier's state, with the admission policy its `admission` names or, without one,
        those its `write` and `min_age` imply."""
        if config.admission is None:
            admission = default_admission(config)
        else:
            admission = (admission_class(config.admission)(config),)
        return cls(config, tier, index, tier.indexed, admission)

    @property
    def name(self) -> str:
        return self.config.name
