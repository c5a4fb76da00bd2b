"""The primary pool's bookkeeping: unit tests, and a Hypothesis state machine against a model."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from tiering import primary
from tiering.errors import StateError
from tiering.keys import BlockKey, make_key
from tiering.policies import policy_names
from tiering.primary import KeyState, LookupResult, PrimaryEvent, PrimaryPool


def k(i: int) -> BlockKey:
    return make_key(i.to_bytes(32, "big"))


def stored(pool: PrimaryPool, *ids: int) -> list[BlockKey]:
    keys = [k(i) for i in ids]
    grant = pool.prepare_store(keys)
    assert grant is not None
    pool.complete_store(grant.keys)
    return keys


@pytest.fixture(params=policy_names())
def policy(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=["compiled", "python"])
def store_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test of the pool runs on both store paths: the compiled one (tiering/_pool.c)
    and the Python fallback (the state machine draws one per run)."""
    if request.param == "python":
        monkeypatch.setattr(primary, "_CORE", None)
    else:
        assert primary._CORE is not None, "the install did not build tiering/_pool.c"
    return str(request.param)


@pytest.mark.usefixtures("store_path")
class TestLifecycle:
    def test_store_then_lookup(self, policy: str) -> None:
        pool = PrimaryPool(4, policy)
        a, b = k(1), k(2)
        assert pool.lookup(a) is LookupResult.MISS
        grant = pool.prepare_store([a, b])
        assert grant is not None
        assert grant.keys == (a, b) and grant.slots == (0, 1) and grant.evicted == ()
        assert pool.lookup(a) is LookupResult.PENDING and pool.state(a) is KeyState.WRITING
        assert pool.num_writing == 2 and pool.num_free == 2
        pool.complete_store([a])
        assert pool.lookup(a) is LookupResult.HIT and pool.lookup(b) is LookupResult.PENDING
        pool.complete_store({b})
        assert pool.state(b) is KeyState.READY and pool.num_writing == 0

    def test_prepare_store_skips_present_and_keeps_order(self, policy: str) -> None:
        pool = PrimaryPool(8, policy)
        stored(pool, 2)
        writing = pool.prepare_store([k(4)])
        assert writing is not None
        grant = pool.prepare_store([k(1), k(2), k(3), k(4), k(5), k(1)])
        assert grant is not None
        assert grant.keys == (k(1), k(3), k(5))
        assert len(set(grant.slots)) == 3 and set(grant.slots).isdisjoint({pool.slot(k(2))})

    def test_prepare_store_of_nothing_new(self, policy: str) -> None:
        pool = PrimaryPool(2, policy)
        stored(pool, 1, 2)
        grant = pool.prepare_store([k(1), k(2)])
        assert grant is not None and grant.keys == () and grant.evicted == ()

    def test_eviction_frees_slots_for_new_keys(self, policy: str) -> None:
        pool = PrimaryPool(3, policy)
        stored(pool, 1, 2, 3)
        grant = pool.prepare_store([k(4), k(5)])
        assert grant is not None
        assert grant.evicted == (k(1), k(2))
        assert set(grant.slots) == {0, 1}
        assert pool.lookup(k(1)) is LookupResult.MISS and k(1) not in pool

    def test_never_evicts_pinned_or_writing_or_own_keys(self, policy: str) -> None:
        pool = PrimaryPool(4, policy)
        stored(pool, 1, 2, 3)
        pool.prepare_load([k(1)])
        writing = pool.prepare_store([k(4)])
        assert writing is not None
        # Full: 1 pinned, 4 writing, 2 offered again by this call, so only 3 may go.
        grant = pool.prepare_store([k(2), k(5)])
        assert grant is not None and grant.evicted == (k(3),)
        # Full: 1 pinned, 4 and 5 writing; 2 is the only evictable key, unless offered.
        assert pool.prepare_store([k(2), k(6)]) is None
        assert pool.state(k(2)) is KeyState.READY
        grant = pool.prepare_store([k(6)])
        assert grant is not None and grant.evicted == (k(2),)
        assert {pool.state(k(i)) for i in (1, 4, 5)} == {KeyState.READING, KeyState.WRITING}

    def test_all_or_nothing_when_too_few_evictable(self, policy: str) -> None:
        pool = PrimaryPool(3, policy)
        stored(pool, 1, 2, 3)
        pool.prepare_load([k(1), k(2)])
        before = (pool.num_used, pool.num_free, [pool.state(k(i)) for i in (1, 2, 3)])
        assert pool.prepare_store([k(4), k(5)]) is None
        assert (pool.num_used, pool.num_free, [pool.state(k(i)) for i in (1, 2, 3)]) == before
        assert pool.prepare_store([k(3), k(4)]) is None  # 3 is offered, hence protected
        assert pool.state(k(3)) is KeyState.READY
        grant = pool.prepare_store([k(4)])
        assert grant is not None and grant.evicted == (k(3),)

    def test_failed_store_frees_the_slot(self, policy: str) -> None:
        pool = PrimaryPool(2, policy)
        grant = pool.prepare_store([k(1), k(2)])
        assert grant is not None
        pool.complete_store([k(1)], ok=False)
        assert k(1) not in pool and pool.num_free == 1
        again = pool.prepare_store([k(3)])
        assert again is not None and again.slots == (grant.slots[0],) and again.evicted == ()

    def test_load_pins_and_counts_readers(self, policy: str) -> None:
        pool = PrimaryPool(4, policy)
        a, b = stored(pool, 1, 2)
        assert pool.prepare_load([b, a]) == [pool.slot(b), pool.slot(a)]
        pool.prepare_load([a])
        assert pool.ref_count(a) == 2 and pool.state(a) is KeyState.READING
        assert pool.num_reading == 2
        pool.complete_load({a, b})
        assert pool.ref_count(a) == 1 and pool.state(b) is KeyState.READY
        pool.complete_load([a])
        assert pool.state(a) is KeyState.READY and pool.num_reading == 0

    def test_load_is_a_use(self) -> None:
        pool = PrimaryPool(3, "lru")
        a, b, c = stored(pool, 1, 2, 3)
        pool.prepare_load([a])
        pool.complete_load([a])
        grant = pool.prepare_store([k(4)])
        assert grant is not None and grant.evicted == (b,)

    def test_lookup_is_not_a_use(self) -> None:
        pool = PrimaryPool(2, "lru")
        a, _ = stored(pool, 1, 2)
        pool.lookup(a)
        grant = pool.prepare_store([k(3)])
        assert grant is not None and grant.evicted == (a,)

    def test_touch(self) -> None:
        pool = PrimaryPool(2, "lru")
        a, b = stored(pool, 1, 2)
        pool.touch([k(9), a])
        grant = pool.prepare_store([k(3)])
        assert grant is not None and grant.evicted == (b,)


@pytest.mark.usefixtures("store_path")
class TestMisuse:
    def test_complete_store_twice(self) -> None:
        pool = PrimaryPool(2)
        a, b = stored(pool, 1, 2)
        with pytest.raises(
            StateError, match=f"complete_store: key {a.hex()} is ready, not being written"
        ):
            pool.complete_store([a])

    def test_complete_store_unknown_changes_nothing(self) -> None:
        pool = PrimaryPool(2)
        grant = pool.prepare_store([k(1)])
        assert grant is not None
        with pytest.raises(StateError, match="not resident, not being written"):
            pool.complete_store([k(1), k(7)])
        assert pool.state(k(1)) is KeyState.WRITING

    def test_load_not_ready(self) -> None:
        pool = PrimaryPool(2)
        pool.prepare_store([k(1)])
        with pytest.raises(StateError, match="is writing, not ready"):
            pool.prepare_load([k(1)])
        with pytest.raises(StateError, match="is not resident, not ready"):
            pool.prepare_load([k(5)])

    def test_load_duplicate_changes_nothing(self) -> None:
        pool = PrimaryPool(2)
        a, b = stored(pool, 1, 2)
        with pytest.raises(StateError, match="more than once"):
            pool.prepare_load([a, b, a])
        assert pool.ref_count(a) == 0 and pool.num_reading == 0

    def test_complete_load_unpinned(self) -> None:
        pool = PrimaryPool(2)
        a, b = stored(pool, 1, 2)
        pool.prepare_load([a])
        with pytest.raises(StateError, match="is ready, not being read"):
            pool.complete_load([a, b])
        assert pool.ref_count(a) == 1

    def test_queries_of_absent_keys(self) -> None:
        pool = PrimaryPool(2)
        with pytest.raises(StateError, match="slot: key .* is not resident"):
            pool.slot(k(3))
        assert pool.state(k(3)) is None

    def test_bad_construction(self) -> None:
        with pytest.raises(ValueError, match="num_slots must be a positive integer"):
            PrimaryPool(0)
        with pytest.raises(ValueError, match="known: arc, lru"):
            PrimaryPool(4, "mru")


@pytest.mark.usefixtures("store_path")
class TestEventsAndReset:
    def test_events(self) -> None:
        pool = PrimaryPool(2, events=True)
        a, b = stored(pool, 1, 2)
        grant = pool.prepare_store([k(3)])
        assert grant is not None
        pool.complete_store(grant.keys, ok=False)
        assert pool.take_events() == [
            PrimaryEvent((a, b), removed=False),
            PrimaryEvent((a,), removed=True),
        ]
        assert pool.take_events() == []

    def test_no_events_unless_asked(self) -> None:
        pool = PrimaryPool(1)
        stored(pool, 1)
        stored(pool, 2)
        assert pool.take_events() == []

    def test_reset_forgets_everything(self, policy: str) -> None:
        pool = PrimaryPool(3, policy, events=True)
        a, b = stored(pool, 1, 2)
        pool.prepare_load([a])
        pool.prepare_store([k(3)])
        pool.take_events()
        pool.reset()
        assert pool.take_events() == [PrimaryEvent((a, b), removed=True)]
        assert len(pool) == 0 and pool.num_free == 3
        assert pool.num_reading == 0 and pool.num_writing == 0
        assert pool.lookup(a) is LookupResult.MISS
        grant = pool.prepare_store([k(4), k(5), k(6)])
        assert grant is not None and grant.slots == (0, 1, 2) and grant.evicted == ()


@dataclass
class Entry:
    state: str  # "writing" or "ready"
    readers: int = 0


@dataclass
class Model:
    capacity: int
    entries: dict[BlockKey, Entry] = field(default_factory=dict)
    announced: set[BlockKey] = field(default_factory=set)  # per the events: stored, not removed


KEYS = st.integers(min_value=0, max_value=24).map(k)


class PrimaryMachine(RuleBasedStateMachine):
    """The pool against a dict model: no pinned or written key evicted, ref counts never
    negative, capacity never exceeded, states and events consistent."""

    stores = Bundle("stores")
    loads = Bundle("loads")

    @initialize(
        capacity=st.integers(min_value=1, max_value=8),
        policy=st.sampled_from(policy_names()),
        compiled=st.booleans(),
    )
    def start(self, capacity: int, policy: str, compiled: bool) -> None:
        self.pool = PrimaryPool(capacity, policy, events=True)
        if not compiled:
            self.pool._core = None  # the Python store path
        self.model = Model(capacity)

    def drain_events(self) -> None:
        for event in self.pool.take_events():
            if event.removed:
                assert set(event.keys) <= self.model.announced
                self.model.announced -= set(event.keys)
            else:
                assert not set(event.keys) & self.model.announced
                self.model.announced |= set(event.keys)

    @rule(target=stores, keys=st.lists(KEYS, max_size=6))
    def prepare_store(self, keys: list[BlockKey]) -> object:
        entries = self.model.entries
        new = list(dict.fromkeys(key for key in keys if key not in entries))
        evictable = [
            key
            for key, e in entries.items()
            if e.state == "ready" and e.readers == 0 and key not in keys
        ]
        feasible = len(new) <= self.model.capacity - len(entries) + len(evictable)
        grant = self.pool.prepare_store(keys)
        if not feasible:
            assert grant is None
            return multiple()
        assert grant is not None
        assert list(grant.keys) == new
        assert set(grant.evicted) <= set(evictable)  # never pinned, written or offered
        need = len(new) - (self.model.capacity - len(entries))
        assert len(grant.evicted) == max(need, 0)
        for key in grant.evicted:
            del entries[key]
        for key in new:
            entries[key] = Entry("writing")
        return multiple(tuple(grant.keys)) if grant.keys else multiple()

    @rule(job=consumes(stores), ok=st.booleans())
    def complete_store(self, job: tuple[BlockKey, ...], ok: bool) -> None:
        self.pool.complete_store(set(job), ok=ok)
        for key in job:
            if ok:
                self.model.entries[key].state = "ready"
            else:
                del self.model.entries[key]

    @rule(target=loads, data=st.data())
    def prepare_load(self, data: st.DataObject) -> object:
        ready = sorted(key for key, e in self.model.entries.items() if e.state == "ready")
        if not ready:
            return multiple()
        keys = data.draw(st.lists(st.sampled_from(ready), min_size=1, max_size=4, unique=True))
        slots = self.pool.prepare_load(keys)
        assert slots == [self.pool.slot(key) for key in keys]
        for key in keys:
            self.model.entries[key].readers += 1
        return tuple(keys)

    @rule(job=consumes(loads))
    def complete_load(self, job: tuple[BlockKey, ...]) -> None:
        self.pool.complete_load(set(job))
        for key in job:
            self.model.entries[key].readers -= 1

    @rule(key=KEYS)
    def lookup(self, key: BlockKey) -> None:
        entry = self.model.entries.get(key)
        expected = (
            LookupResult.MISS
            if entry is None
            else LookupResult.PENDING
            if entry.state == "writing"
            else LookupResult.HIT
        )
        assert self.pool.lookup(key) is expected

    @rule(keys=st.lists(KEYS, max_size=4))
    def touch(self, keys: list[BlockKey]) -> None:
        self.pool.touch(keys)

    @precondition(lambda self: self.model.entries)
    @rule()
    def reset(self) -> None:
        self.pool.reset()
        self.model.entries.clear()
        # Completions of jobs from before the reset never arrive (vLLM's stale-job threshold).
        self.bundles["stores"].clear()  # type: ignore[attr-defined]
        self.bundles["loads"].clear()  # type: ignore[attr-defined]

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "pool"):
            return
        self.drain_events()
        pool, entries = self.pool, self.model.entries
        assert len(pool) == len(entries) <= self.model.capacity
        assert pool.num_free == self.model.capacity - len(entries)
        slots = [pool.slot(key) for key in entries]
        assert len(set(slots)) == len(slots) and all(0 <= s < self.model.capacity for s in slots)
        for key, e in entries.items():
            assert e.readers >= 0
            assert pool.ref_count(key) == e.readers
            expected = (
                KeyState.WRITING
                if e.state == "writing"
                else KeyState.READING
                if e.readers
                else KeyState.READY
            )
            assert pool.state(key) is expected
        ready = {key for key, e in entries.items() if e.state == "ready"}
        assert self.model.announced == ready
        assert pool.num_writing == sum(e.state == "writing" for e in entries.values())
        assert pool.num_reading == sum(e.readers > 0 for e in entries.values())


PrimaryMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestPrimaryMachine = PrimaryMachine.TestCase


@pytest.mark.usefixtures("store_path")
class TestPinsAndReclaim:
    def test_pin_is_not_a_use(self) -> None:
        pool = PrimaryPool(2, "lru")
        a, b = stored(pool, 1, 2)
        assert pool.pin_for_demotion([a]) == [pool.slot(a)]
        pool.release_demotion([a])
        grant = pool.prepare_store([k(3)])
        assert grant is not None and grant.evicted == (a,)  # pinning did not make `a` recent

    def test_a_pinned_block_is_never_evicted_until_its_demotion_is_released(self) -> None:
        pool = PrimaryPool(2, "lru")
        a, b = stored(pool, 1, 2)
        pool.pin_for_demotion([a])
        grant = pool.prepare_store([k(3)])
        assert grant is not None and grant.evicted == (b,)
        assert pool.prepare_store([k(4)]) is None  # a is pinned, k(3) being written
        pool.release_demotion([a])
        with pytest.raises(StateError, match="release_demotion: key .* not being read"):
            pool.release_demotion([a])

    def test_a_promotion_allocates_and_completes_like_a_store(self) -> None:
        pool = PrimaryPool(2, "lru", events=True)
        (a,) = stored(pool, 1)
        pool.take_events()
        assert pool.allocate_for_promotion([a, k(2), k(3)]) is None  # a is its own: kept
        grant = pool.allocate_for_promotion([k(2), k(3)])
        assert grant is not None and grant.keys == (k(2), k(3)) and grant.evicted == (a,)
        assert pool.lookup(k(2)) is LookupResult.PENDING
        pool.complete_promotion([k(2)])
        pool.complete_promotion([k(3)], ok=False)
        assert pool.lookup(k(2)) is LookupResult.HIT and pool.lookup(k(3)) is LookupResult.MISS
        assert pool.num_free == 1
        assert pool.take_events() == [
            PrimaryEvent((a,), removed=True),
            PrimaryEvent((k(2),), removed=False),
        ]
        with pytest.raises(StateError, match="complete_promotion: key .* not being written"):
            pool.complete_promotion([k(2)])

    def test_reclaim_holds_slots_until_released(self) -> None:
        pool = PrimaryPool(3, "lru", events=True)
        a, b, c = stored(pool, 1, 2, 3)
        pool.prepare_load([c])
        pool.take_events()
        victims = pool.reclaim(5)  # only a and b may go: c is pinned
        assert [key for key, _ in victims] == [a, b]
        assert pool.take_events() == [PrimaryEvent((a, b), removed=True)]
        assert pool.lookup(a) is LookupResult.MISS and pool.num_held == 2
        assert pool.num_free == 0 and pool.prepare_store([k(4)]) is None  # held, not free
        pool.release([slot for _, slot in victims])
        grant = pool.prepare_store([k(4), k(5)])
        assert grant is not None and set(grant.slots) == {slot for _, slot in victims}
        with pytest.raises(StateError, match="was not reclaimed"):
            pool.release([0])

    def test_a_bad_release_changes_nothing(self) -> None:
        pool = PrimaryPool(3, "lru")
        stored(pool, 1, 2, 3)
        (_, slot), (_, other) = pool.reclaim(2)
        for bad in ([slot, slot], [other, 99]):
            with pytest.raises(StateError, match="was not reclaimed"):
                pool.release(bad)
            assert pool.num_held == 2 and pool.num_free == 0


class TestCompiledStorePath:
    """tiering/_pool.c against the Python store path it replaces."""

    @staticmethod
    def state(pool: PrimaryPool) -> tuple[object, ...]:
        return (
            list(pool._ref.items()),
            sorted(pool._busy),
            sorted(pool._writing),
            list(pool._free),
            pool.policy.get_many(list(pool._ref)),
            pool.take_events(),
        )

    @pytest.mark.parametrize("seed", range(6))
    def test_every_answer_and_state_is_the_python_paths(self, policy: str, seed: int) -> None:
        """Random stores (with duplicates and resident keys), failed stores, loads and
        reclaims, step by step on both paths: the same grants, errors and containers."""
        import random

        rng = random.Random(seed)
        pools = [PrimaryPool(6, policy, events=True) for _ in range(2)]
        pools[1]._core = None
        assert pools[0]._core is not None
        for _ in range(400):
            op = rng.random()
            keys = [k(rng.randrange(16)) for _ in range(rng.randrange(5))]
            ok = rng.random() < 0.85
            answers: list[object] = []
            for pool in pools:
                try:
                    if op < 0.5:
                        answers.append(pool.prepare_store(iter(keys)))
                    elif op < 0.8:
                        done = sorted(pool._writing)[: len(keys) + 1] + keys[:1]
                        answers.append(pool.complete_store(done, ok))
                    elif op < 0.9:
                        ready = [key for key in pool.ready_keys() if pool.ref_count(key) == 0]
                        answers.append(pool.prepare_load(ready[:2]))
                        pool.complete_load(ready[:2])
                    else:
                        answers.append(pool.release([s for _, s in pool.reclaim(1)]))
                except StateError as e:
                    answers.append(str(e))
            assert answers[0] == answers[1]
            assert self.state(pools[0]) == self.state(pools[1])

    def test_misuse_changes_nothing(self) -> None:
        pool = PrimaryPool(4)
        grant = pool.prepare_store([k(1), k(2)])
        assert grant is not None
        before = TestCompiledStorePath.state(pool)
        with pytest.raises(StateError, match="not being written"):
            pool.complete_store([k(1), k(9)])
        assert TestCompiledStorePath.state(pool) == before
        core = primary._CORE
        with pytest.raises(TypeError):
            core.prepare_store({}, set(), set(), (), pool.policy, [])
        with pytest.raises(TypeError):
            core.complete_store({}, set(), [], [], True)
        with pytest.raises(TypeError):
            pool.prepare_store(5)  # type: ignore[arg-type]

    def test_a_failing_policy_leaves_no_mark(self) -> None:
        """A policy whose `evict` raises, or evicts too few: the call fails, and no key is
        left marked as written or protected."""

        pool = PrimaryPool(2)
        stored(pool, 1, 2)
        before = TestCompiledStorePath.state(pool)
        policy = pool.policy
        real = policy.evict
        try:
            policy.evict = lambda n, protected: 1 / 0  # type: ignore[method-assign]
            with pytest.raises(ZeroDivisionError):
                pool.prepare_store([k(3), k(1), k(3)])
            assert TestCompiledStorePath.state(pool) == before
            policy.evict = lambda n, protected: []  # type: ignore[method-assign]
            with pytest.raises(AssertionError, match="refused to evict"):
                pool.prepare_store([k(3)])
            assert TestCompiledStorePath.state(pool) == before
        finally:
            policy.evict = real  # type: ignore[method-assign]
        assert pool.prepare_store([k(3)]) is not None

    def test_a_policy_may_answer_evict_with_any_sequence_of_pairs(self) -> None:
        """The contract says a list of (key, value) tuples; a registered policy answering
        with a tuple of lists works on the compiled path as on the Python one."""
        pools = [PrimaryPool(2) for _ in range(2)]
        pools[1]._core = None
        for pool in pools:
            stored(pool, 1, 2)
            real = pool.policy.evict
            pool.policy.evict = lambda n, p, real=real: tuple(map(list, real(n, p)))  # type: ignore[method-assign]
        grants = [pool.prepare_store([k(3)]) for pool in pools]
        assert grants[0] == grants[1] and grants[0] is not None and grants[0].evicted == (k(1),)

    def test_no_reference_leaks(self, policy: str) -> None:
        """Keys stored, evicted, failed and forgotten hold no reference afterwards."""
        import sys

        keys = [make_key(bytes([i]) * 32) for i in range(64)]
        counts = [sys.getrefcount(key) for key in keys]
        pool = PrimaryPool(8, policy)
        for round_ in range(4):
            for i in range(0, 64, 4):
                grant = pool.prepare_store(keys[i : i + 4] + keys[i : i + 2])
                assert grant is not None
                pool.complete_store(grant.keys, ok=(i + round_) % 3 != 0)
            del grant
        pool.reset()
        pool.policy.clear()
        assert [sys.getrefcount(key) for key in keys] == counts
