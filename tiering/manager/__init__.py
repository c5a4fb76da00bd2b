"""The tiering manager: the CPU primary pool plus secondary tiers, behind the primary pool's
contract (`offloading.TieringOffloadingManager`: the facade; its module docstring maps the
pieces)."""

from tiering.manager.offloading import TieringOffloadingManager
from tiering.manager.tierstate import TierEvent, build_tiers, close_tiers

__all__ = ["TierEvent", "TieringOffloadingManager", "build_tiers", "close_tiers"]
