"""The manager's figures at one instant: one snapshot object, read by `stats()` (with the
latency samples since the last call, for histograms) and `snapshot()` (with the primary's
gauges, for the Prometheus endpoint)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tiering.manager.counters import HITS_OTHER_WRITER, MANAGER_COUNTERS, TIER_COUNTERS
from tiering.manager.tierstate import TierState
from tiering.manager.usage import UsagePoller
from tiering.primary import PrimaryPool
from tiering.runtime import Runtime

__all__ = ["StatsSnapshot", "breaker_figures"]

_TIER_ZEROS = dict.fromkeys(TIER_COUNTERS, 0.0)
_FROM_TIER = (HITS_OTHER_WRITER,)
"""Counters of `TIER_COUNTERS` that the tier itself keeps (`Tier.counters`)."""
_MANAGER_ZEROS = dict.fromkeys(MANAGER_COUNTERS, 0.0)


@dataclass(frozen=True, slots=True)
class StatsSnapshot:
    """Counters and gauges of a manager. Scheduler process, taken under the step lock; read
    on any thread afterwards (it shares nothing with the manager)."""

    manager: dict[str, float]
    """The manager's own counters."""
    tiers: dict[str, dict[str, Any]]
    """Per tier, by name: its counters, in-flight demotions, breakers, the tier's own
    counters (`tier.*`), its store's usage once polled (`tiering.manager.usage.USAGE_GAUGES`)
    and, with latencies, `seconds_per_block` and `latencies`."""
    primary: dict[str, int] | None = None
    """The primary's gauges (slots, used, writing, reading, held), when taken."""

    @classmethod
    def take(
        cls,
        pool: PrimaryPool,
        tiers: Sequence[TierState],
        counters: Mapping[str, float],
        runtime: Runtime,
        *,
        latencies: bool,
        usage: UsagePoller | None = None,
    ) -> StatsSnapshot:
        """The figures now; with `latencies`, the tiers' latency samples are moved into it
        (the next snapshot has only newer ones) and the primary's gauges left out."""
        figures: dict[str, dict[str, Any]] = {}
        for state in tiers:
            row: dict[str, Any] = {
                **_TIER_ZEROS,
                **state.counters,
                "inflight_demotions": state.inflight,
                **breaker_figures(runtime, state.config.name),
            }
            if latencies:
                samples, state.latencies = state.latencies, []
                row["seconds_per_block"] = state.seconds_per_block
                row["latencies"] = samples
            own = state.tier.counters
            row.update({f"tier.{k}": v for k, v in own.items()})
            row.update({name: own.get(name, 0) for name in _FROM_TIER})
            if usage is not None:
                row.update(usage.figures(state.config.name))
            figures[state.config.name] = row
        primary = None
        if not latencies:
            primary = {
                "slots": pool.num_slots,
                "used": pool.num_used,
                "writing": pool.num_writing,
                "reading": pool.num_reading,
                "held": pool.num_held,
            }
        return cls({**_MANAGER_ZEROS, **counters}, figures, primary)

    def as_dict(self) -> dict[str, Any]:
        """Plain dicts: `{"primary"?, "manager", "tiers"}`."""
        head: dict[str, Any] = {} if self.primary is None else {"primary": self.primary}
        return {**head, "manager": self.manager, "tiers": self.tiers}


def breaker_figures(runtime: Runtime, tier: str) -> dict[str, Any]:
    """A tier's breakers: `breaker` is the state of the one every job passes (closed, open,
    half-open), `write_breaker` the one demotions pass too (opened by a full tier while
    promotions go on); the times each opened, the jobs each refused."""
    breaker, writes = runtime.breaker(tier), runtime.write_breaker(tier)
    return {
        "breaker": breaker.state,
        "breaker_opened": breaker.opened,
        "breaker_refused": breaker.refused,
        "write_breaker": writes.state,
        "write_breaker_opened": writes.opened,
        "write_breaker_refused": writes.refused,
    }
