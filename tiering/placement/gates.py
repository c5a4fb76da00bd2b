"""The built-in promotion gates (`promotion.gate`): `auto`, `always`, `never`."""

from __future__ import annotations

from tiering.placement.base import PromotionGate, TierFigures

__all__ = ["AlwaysGate", "AutoGate", "NeverGate"]


class AutoGate(PromotionGate):
    """Promote while the tier's measured time per block beats recomputing the block at
    `prefill_rate` (a slow Redis must never make TTFT worse); with nothing measured yet, try
    and learn. Scheduler process, scheduler thread."""

    def allows(self, tier: TierFigures) -> bool:
        seconds = tier.seconds_per_block
        if seconds is None:
            return True
        return seconds < self.block_tokens / self.prefill_rate


class AlwaysGate(PromotionGate):
    """Promote every hit. Scheduler process, scheduler thread."""

    always_open = True

    def allows(self, tier: TierFigures) -> bool:
        return True


class NeverGate(PromotionGate):
    """Promote nothing: a secondary hit is a miss (the tiers still take demotions). Scheduler
    process, scheduler thread."""

    def allows(self, tier: TierFigures) -> bool:
        return False
