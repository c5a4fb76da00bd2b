"""The placement contracts: which blocks a tier takes (admission) and whether a tier's hit is
worth loading (the promotion gate).

A placement policy is a small object the manager asks; it holds no lock, does no I/O and
knows nothing of slots, pins or jobs (the manager owns those), as vLLM's `kv_offload`
admission policies know nothing of its transfers. Policies are looked up by name
(`tiering.placement.registry`), so a deployment plugs one in from the YAML.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

from tiering.keys import BlockKey

if TYPE_CHECKING:
    from tiering.config import TierConfig

__all__ = ["AdmissionPolicy", "BlockHistory", "PromotionGate", "TierFigures"]


@dataclass(slots=True)
class BlockHistory:
    """What admission policies may know of the primary's blocks. Scheduler process, under the
    manager's step lock (scheduler or runtime thread).

    Kept only as far as some tier's policy needs it (`hits` when one declares `needs_hits`,
    `stored_at` when one declares `needs_age`): the store and load paths pay nothing otherwise.
    """

    tracks_hits: bool = False
    tracks_age: bool = False
    hits: dict[BlockKey, int] = field(default_factory=dict)
    """Loads of each resident block (`prepare_load` calls that named it)."""
    stored_at: dict[BlockKey, float] = field(default_factory=dict)
    """When each resident block was stored, on the manager's clock."""

    def loaded(self, keys: Iterable[BlockKey]) -> None:
        hits = self.hits
        for key in keys:
            hits[key] = hits.get(key, 0) + 1

    def stored(self, keys: Iterable[BlockKey], now: float) -> None:
        self.stored_at.update(dict.fromkeys(keys, now))

    def forget(self, keys: Iterable[BlockKey]) -> None:
        """Blocks that left the primary."""
        if self.tracks_hits or self.tracks_age:
            hits, stored_at = self.hits, self.stored_at
            for key in keys:
                hits.pop(key, None)
                stored_at.pop(key, None)

    def clear(self) -> None:
        self.hits.clear()
        self.stored_at.clear()


class AdmissionPolicy(ABC):
    """Which of the blocks leaving the primary a write-back or selective tier takes. Scheduler
    process, under the manager's step lock (scheduler or runtime thread); not thread-safe.

    Built once per tier with the tier's configuration (`AdmissionPolicy(tier_config)`).

    Guaranteed by the manager:
    - `admit` is given only blocks the tier is not known to hold already;
    - `history` holds `hits` when the policy declares `needs_hits`, `stored_at` when it
      declares `needs_age` (a block missing there was never counted: 0 hits, stored `now`);
    - the blocks' bytes stay valid until the demotions the manager submits end.

    The implementation must:
    - return a subsequence of `blocks`, in order (the manager demotes exactly those);
    - cost O(len(blocks)) and never block: it runs between engine steps.
    """

    needs_hits: ClassVar[bool] = False
    needs_age: ClassVar[bool] = False

    def __init__(self, tier: TierConfig) -> None:
        self.tier = tier

    @abstractmethod
    def admit(
        self, blocks: Sequence[tuple[BlockKey, int]], history: BlockHistory, now: float
    ) -> Sequence[tuple[BlockKey, int]]:
        """The (key, slot) pairs of `blocks` to demote to this tier."""


class TierFigures(Protocol):
    """Scheduler process, under the step lock: what a gate may read of a tier, its name and
    its measured promotion time."""

    @property
    def name(self) -> str: ...

    @property
    def seconds_per_block(self) -> float | None:
        """Moving average of promotion time per block (None: nothing measured yet)."""


class PromotionGate(ABC):
    """Whether a hit in a secondary tier is promoted or answered as a miss (recomputed).
    Scheduler process, scheduler thread, inside `lookup`; not thread-safe.

    Built once per manager: `PromotionGate(block_tokens=..., prefill_rate=...)`, the tokens of
    one block and the engine's prefill rate in tokens per second (`promotion.prefill_rate`).

    Guaranteed by the manager: `allows` is called once per secondary hit it would promote, with
    the figures of the first tier (in order) that holds the block.

    The implementation must answer in O(1) without I/O (`lookup` never waits). A gate whose
    answer is always yes sets `always_open`: the manager then skips the call.
    """

    always_open: ClassVar[bool] = False

    def __init__(self, *, block_tokens: int, prefill_rate: float) -> None:
        self.block_tokens = block_tokens
        self.prefill_rate = prefill_rate

    @abstractmethod
    def allows(self, tier: TierFigures) -> bool:
        """Whether to promote a block `tier` holds."""
