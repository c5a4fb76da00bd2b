"""The built-in admission policies: `min-hits` (a `selective` tier's `admit_after_hits`) and
`min-age` (a tier's `min_age`), and the policies a tier's configuration implies."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tiering.keys import BlockKey
from tiering.placement.base import AdmissionPolicy, BlockHistory

if TYPE_CHECKING:
    from tiering.config import TierConfig

__all__ = ["AdmitAll", "MinAge", "MinHits", "default_admission"]


class AdmitAll(AdmissionPolicy):
    """Every block (a `back` tier without `min_age`). Scheduler process, under the step lock."""

    def admit(
        self, blocks: Sequence[tuple[BlockKey, int]], history: BlockHistory, now: float
    ) -> Sequence[tuple[BlockKey, int]]:
        return blocks


class MinHits(AdmissionPolicy):
    """Blocks loaded at least `admit_after_hits` times (spares a tier the blocks used once).
    Scheduler process, under the step lock."""

    needs_hits = True

    def admit(
        self, blocks: Sequence[tuple[BlockKey, int]], history: BlockHistory, now: float
    ) -> Sequence[tuple[BlockKey, int]]:
        hits, need = history.hits.get, self.tier.admit_after_hits
        return [block for block in blocks if hits(block[0], 0) >= need]


class MinAge(AdmissionPolicy):
    """Blocks that spent at least `min_age` seconds in the primary (spares SSD wear and network
    on blocks that die young). Scheduler process, under the step lock."""

    needs_age = True

    def admit(
        self, blocks: Sequence[tuple[BlockKey, int]], history: BlockHistory, now: float
    ) -> Sequence[tuple[BlockKey, int]]:
        stored_at, age = history.stored_at.get, self.tier.min_age
        return [block for block in blocks if now - stored_at(block[0], now) >= age]


def default_admission(tier: TierConfig) -> tuple[AdmissionPolicy, ...]:
    """The policies a tier's `write` and `min_age` imply, applied in this order: `min-hits`
    for a `selective` tier, then `min-age` when it is positive (none: every block)."""
    policies: list[AdmissionPolicy] = []
    if tier.write == "selective":
        policies.append(MinHits(tier))
    if tier.min_age > 0:
        policies.append(MinAge(tier))
    return tuple(policies)
