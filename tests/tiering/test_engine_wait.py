"""The engine-wait machinery under its worst cases: stale deadlines, late promotions, shutdown,
the interpreter's rounding of the switch interval (`tiering.gil`, the manager's urgency and idle
waits)."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.helpers.manager import HIT, MISS, PENDING, Harness, k, memory_tier
from tests.tiers.memory_hooks import plant
from tiering import gil
from tiering.config import TierConfig
from tiering.keys import BlockKey
from tiering.testing import NAMESPACE
from tiers.memory import MemoryTier

pytestmark = pytest.mark.usefixtures("interval")  # (tests/tiering/conftest.py)


class DelayTier(MemoryTier):
    """Each read sleeps the next of `delays` seconds (0 once they run out), uncancellable."""

    delays: list[float]

    async def _read(self, key: BlockKey, limit: int) -> bytes | None:
        delay = self.delays.pop(0) if self.delays else 0.0
        work = asyncio.ensure_future(asyncio.sleep(delay))
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            await work
            raise
        return self._index.get(key)


class HangTier(MemoryTier):
    """Reads that hang until cancelled (a stuck backend)."""

    async def _read(self, key: BlockKey, limit: int) -> bytes | None:
        await asyncio.sleep(3600)
        return None


def tier_of(cls: type, h_block: Callable[[int], bytes] | None = None, **kw: Any) -> Any:
    tier = cls(namespace=NAMESPACE, name="mem")
    return TierConfig(name="mem", type="memory", write="back"), tier


# -- 1. tiering.gil ------------------------------------------------------------------------------


def test_gil_restores_an_interval_the_interpreter_rounds(interval: float) -> None:
    """CPython keeps the switch interval in whole microseconds: 0.0001234 s reads back as
    0.000123 s, so `_release` never recognises kvtier's own value and leaves it forever."""
    gil.configure(0.0001234)
    owner = gil.Urgency()
    owner.set(True)
    owner.set(False)
    assert sys.getswitchinterval() == pytest.approx(interval)


def test_gil_restores_after_a_configure_while_held(interval: float) -> None:
    """A second engine's config (another switch_interval) while the first holds a claim."""
    owner = gil.Urgency()
    owner.set(True)
    gil.configure(0.001)
    owner.set(False)
    assert sys.getswitchinterval() == pytest.approx(interval)


# -- 1/4. the manager's claim outlives shutdown --------------------------------------------------


def test_shutdown_leaves_no_claim_behind(make: Callable[..., Harness], interval: float) -> None:
    """A promotion still in flight at shutdown (a stuck tier): `shutdown` releases the claim,
    then the runtime's next tick (the promotion past its deadline) claims it again, and the
    runtime stops before any tick releases it: the process keeps a 0.5 ms interval."""
    cfg, tier = tier_of(HangTier)
    h = make([(cfg, tier)], slots=4, reserve=1, promotion_deadline=0.2)
    plant(tier, k(1), tier._encode(k(1), h.block(1))[1][0] + h.block(1))
    assert h.manager.lookup(k(1)) is PENDING
    h.manager.on_schedule_end()
    time.sleep(0.05)
    h.manager.shutdown(flush=0.01)
    assert gil.holders() == 0
    assert sys.getswitchinterval() == pytest.approx(interval)


# -- 2. idle waits --------------------------------------------------------------------------------


def test_an_idle_step_wakes_when_its_promotion_turns_late(
    make: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past its deadline a promotion's key reads MISS (the request may recompute now), but a
    drain that set `progress` only for arrivals let the idle step sleep its whole IDLE_WAIT."""
    from tiering.manager import offloading

    monkeypatch.setattr(offloading, "IDLE_WAIT", 3.0)  # stands for 5 ms, made visible
    cfg, tier = tier_of(DelayTier)
    tier.delays = [2.0]
    h = make([(cfg, tier)], slots=4, reserve=1, promotion_deadline=0.2)
    plant(tier, k(1), tier._encode(k(1), h.block(1))[1][0] + h.block(1))
    assert h.manager.lookup(k(1)) is PENDING
    h.manager.on_schedule_end()
    time.sleep(0.05)
    assert h.manager.lookup(k(1)) is PENDING
    began = time.monotonic()
    h.manager.on_schedule_end(idle=True)
    waited = time.monotonic() - began
    assert waited < 1.0, f"the idle step slept {waited:.2f}s past the promotion's deadline"
    assert h.manager.lookup(k(1)) is MISS  # late: recompute
    h.manager.on_schedule_end()


# -- 6. deadlines ---------------------------------------------------------------------------------


def test_a_stale_deadline_does_not_make_a_later_promotion_of_the_same_key_late(
    make: Callable[..., Harness],
) -> None:
    """The heap keeps a finished batch's entry until its deadline; `mark_late` then marks its
    keys late if they are being promoted again, by another batch with its own later deadline."""
    cfg, tier = tier_of(DelayTier)
    tier.delays = [0.0, 0.45]  # the first promotion is quick, the second takes 0.45 s
    h = make([(cfg, tier)], slots=2, reserve=1, promotion_deadline=0.5)
    for i in (1, 2, 3):
        plant(tier, k(i), tier._encode(k(i), h.block(i))[1][0] + h.block(i))
    t0 = time.monotonic()
    h.lookup_until(1, HIT)  # batch X: deadline t0 + 0.5, done at once
    h.manager.complete_load([])  # (no load in flight)
    # evict k(1): two other blocks through a 2-slot primary
    h.store(2)
    h.store(3)
    h.settle()
    assert h.manager.pool.lookup(k(1)) is MISS
    time.sleep(max(0.0, t0 + 0.25 - time.monotonic()))
    assert h.manager.lookup(k(1)) is PENDING  # batch Y: deadline ~t0 + 0.75, takes 0.45 s
    h.manager.on_schedule_end()
    time.sleep(max(0.0, t0 + 0.6 - time.monotonic()))  # past X's deadline, not Y's
    seen = h.manager.lookup(k(1))
    h.manager.on_schedule_end()
    assert seen is PENDING, "marked late by the finished batch's deadline"
    assert h.manager.counters["promotions_late"] == 0


def test_a_late_promotion_no_longer_holds_the_claim_nor_makes_idle_steps_wait(
    make: Callable[..., Harness], interval: float
) -> None:
    """A stuck tier: past its deadline the promotion's key reads MISS (the engine recomputes,
    waits on nothing), yet the promotion stays in `_promoting` until the tier lets go, so the
    claim (0.5 ms switch interval for the whole process) and the idle waits go on with it."""
    cfg, tier = tier_of(DelayTier)
    tier.delays = [3.0]  # a read that cannot be stopped (the file tier's pool threads)
    h = make([(cfg, tier)], slots=4, reserve=1, promotion_deadline=0.2)
    plant(tier, k(1), tier._encode(k(1), h.block(1))[1][0] + h.block(1))
    assert h.manager.lookup(k(1)) is PENDING
    h.manager.on_schedule_end()
    time.sleep(0.3)
    assert h.manager.lookup(k(1)) is MISS  # late: the engine recomputes it
    h.manager.on_schedule_end()
    waits = h.manager.counters["idle_waits"]
    h.manager.on_schedule_end(idle=True)
    assert h.manager.counters["idle_waits"] == waits, "an idle step waited on a late promotion"
    assert gil.holders() == 0 and sys.getswitchinterval() == pytest.approx(interval)


def test_a_second_shutdown_does_not_raise(make: Callable[..., Harness]) -> None:
    """`_flush` submits to the runtime without a guard: on a runtime already shut down (a second
    shutdown, after a store completed meanwhile) `submit_many` raises StateError out of
    `shutdown`, and the tiers are not closed (the vLLM adapter's region.close is skipped)."""
    cfg, tier = memory_tier(indexed=True)
    h = make([(cfg, tier)])
    h.store(1)
    h.manager.shutdown()
    h.store(2)  # e.g. the engine's last store report, after a shutdown from another thread
    h.manager.shutdown()
