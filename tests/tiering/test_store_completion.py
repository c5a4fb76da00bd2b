"""How the manager ends the engine's stores (`complete_store`), as vLLM's interface defines it
(connectors/vllm/versions.py: failed stores reach the manager from vLLM 0.34): a failed store's
blocks are dropped and their slots freed, never served or demoted; keys the engine is not
writing are ignored and counted, never a `StateError` that leaves the call's other keys
WRITING for good."""

from __future__ import annotations

from collections.abc import Callable

from tests.helpers.manager import HIT, MISS, PENDING, Harness, k, memory_tier
from tests.tiers.memory_hooks import stored
from tiering.primary import KeyState


def test_keys_not_being_written_are_ignored_and_the_others_complete(
    make: Callable[..., Harness],
) -> None:
    h = make([], slots=8)
    manager = h.manager
    h.store(1)  # ready
    grant = manager.prepare_store([k(2), k(3)])
    assert grant is not None
    manager.on_schedule_end()
    # an unknown key, a ready one, a key twice, and the two being written
    manager.complete_store([k(9), k(1), k(2), k(2), k(3)])
    pool = manager.pool
    assert pool.state(k(2)) is KeyState.READY and pool.state(k(3)) is KeyState.READY
    assert pool.state(k(1)) is KeyState.READY and pool.state(k(9)) is None
    assert pool.num_writing == 0
    assert manager.counters["store_completions_ignored"] == 3  # 9, 1 and the second 2


def test_a_failed_store_frees_its_slots_and_is_never_served_or_demoted(
    make: Callable[..., Harness],
) -> None:
    config, tier = memory_tier(write="through")
    h = make([(config, tier)], slots=4)
    manager = h.manager
    grant = manager.prepare_store([k(1), k(2)])
    assert grant is not None
    manager.on_schedule_end()
    assert manager.lookup(k(1)) is PENDING
    manager.on_schedule_end()
    manager.complete_store([k(1), k(2)], ok=False)
    h.settle()
    assert manager.pool.num_used == 0 and manager.pool.num_free == 4
    assert manager.counters["stores_failed"] == 2
    assert stored(tier, k(1)) is None and stored(tier, k(2)) is None
    assert manager.lookup(k(1)) is not PENDING
    manager.on_schedule_end()
    h.settle()
    assert h.lookup_until(1, MISS)[-1] is MISS


def test_the_engine_cannot_complete_a_promotion(make: Callable[..., Harness]) -> None:
    """A key the manager is promoting is WRITING too, but not the engine's: a completion of it
    (a confused or stale engine job) is ignored, and the promotion still ends it."""
    config, tier = memory_tier(write="through")
    h = make([(config, tier)], slots=4)
    h.demote_and_forget(1)
    seen = h.lookup_until(1, PENDING)
    assert seen[-1] is PENDING
    h.manager.complete_store([k(1)], ok=False)
    assert h.manager.counters["store_completions_ignored"] == 1
    assert h.manager.counters["stores_failed"] == 0
    h.manager.on_schedule_end()
    h.lookup_until(1, HIT)
    assert h.slot_bytes(1) == h.block(1)
