"""Eviction policies: the shared contract for every registered policy, ARC's own behaviour,
and the registry."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable
from typing import Any

import pytest

import tiering.policies as policies
import tiering.policies.arc as arc_module
from kvtier.trace import load_trace, trace_keys
from tests.helpers.paths import ROOT
from tests.tiering.arc_reference import ReferenceARC
from tiering.config import parse_config
from tiering.errors import ConfigError, UnknownNameError
from tiering.keys import BlockKey
from tiering.policies import (
    ARCPolicy,
    EvictionPolicy,
    LRUPolicy,
    create_policy,
    get_policy_class,
    policy_names,
    register_policy,
)
from tiering.primary import LookupResult, PrimaryPool
from tiering.testing.policies import MakePolicy, PolicyContract


class TestEveryRegisteredPolicy(PolicyContract):
    @pytest.fixture(params=policy_names())
    def make_policy(self, request: pytest.FixtureRequest) -> MakePolicy:
        cls = get_policy_class(request.param)
        return lambda capacity: cls(capacity)  # type: ignore[return-value]

    def test_get_many_is_get_of_each(self, make_policy: MakePolicy) -> None:
        policy = make_policy(4)
        self.fill(policy, 4)
        policy.touch(["k1"])  # in ARC, k1 is in T2 and the others in T1
        keys = ["k3", "k1", "absent", "k0", "k1"]
        assert policy.get_many(iter(keys)) == [3, 1, None, 0, 1]
        assert policy.get_many(keys) == [policy.get(key) for key in keys]
        policy.evict(1, set())
        assert policy.get_many(["k0", "k2"]) == [None, 2]


class FIFOPolicy(EvictionPolicy[object, object]):
    """A minimal custom policy: first in, first out; touches are ignored."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.entries: OrderedDict[object, object] = OrderedDict()

    def get(self, key: object) -> object | None:
        return self.entries.get(key)

    def insert(self, key: object, value: object) -> None:
        self.entries[key] = value

    def remove(self, key: object) -> object:
        return self.entries.pop(key)

    def touch(self, keys: Iterable[object]) -> None:
        pass

    def evict(self, n: int, protected: Container[object]) -> list[tuple[object, object]] | None:
        victims = [k for k in self.entries if k not in protected][:n]
        if len(victims) < n:
            return None
        return [(k, self.entries.pop(k)) for k in victims]

    def clear(self) -> None:
        self.entries.clear()

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: object) -> bool:
        return key in self.entries


@pytest.fixture
def clean_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(policies.POLICIES, "_table", dict(policies.POLICIES._table))


class TestRegistry:
    def test_builtins(self) -> None:
        assert policy_names() == ["arc", "lru"]
        assert get_policy_class("lru") is LRUPolicy and get_policy_class("arc") is ARCPolicy
        assert isinstance(create_policy("arc", 8), ARCPolicy)

    def test_unknown_name_lists_known_and_suggests(self) -> None:
        with pytest.raises(
            UnknownNameError,
            match=r"unknown eviction policy 'lur' \(did you mean 'lru'\?\); known: arc, lru",
        ):
            get_policy_class("lur")
        with pytest.raises(ValueError, match="known: arc, lru"):
            create_policy("belady", 4)

    @pytest.mark.usefixtures("clean_registry")
    def test_custom_policy_class(self) -> None:
        register_policy("fifo", FIFOPolicy)
        assert "fifo" in policy_names()
        pool = PrimaryPool(2, "fifo")
        keys = [bytes([i]) * 8 for i in range(3)]
        grant = pool.prepare_store(keys[:2])
        assert grant is not None
        pool.complete_store(grant.keys)
        pool.touch([keys[0]])  # ignored by FIFO
        grant = pool.prepare_store([keys[2]])
        assert grant is not None and grant.evicted == (keys[0],)

    @pytest.mark.usefixtures("clean_registry")
    def test_custom_policy_by_import_path(self) -> None:
        register_policy("lru2", "tiering.policies.lru:LRUPolicy")
        assert get_policy_class("lru2") is LRUPolicy

    @pytest.mark.usefixtures("clean_registry")
    def test_bad_registrations(self) -> None:
        with pytest.raises(ConfigError, match="already registered"):
            register_policy("lru", FIFOPolicy)
        with pytest.raises(ConfigError, match="must be lowercase"):
            register_policy("My Policy", FIFOPolicy)
        with pytest.raises(ConfigError, match="not an EvictionPolicy subclass"):
            register_policy("dict", dict)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="expected 'package.module:Class'"):
            register_policy("nocolon", "tiering.policies.lru.LRUPolicy")
        register_policy("missing", "tiering.nowhere:Policy")
        with pytest.raises(ConfigError, match="cannot import 'tiering.nowhere:Policy'"):
            get_policy_class("missing")
        register_policy("notapolicy", "collections:OrderedDict")
        with pytest.raises(ConfigError, match="is not an EvictionPolicy"):
            get_policy_class("notapolicy")


def _use(policy: EvictionPolicy[str, int], key: str, protected: Container[str] = ()) -> None:
    """One reference to `key`, the way the primary pool makes it: a hit is a touch; a miss
    evicts one key if the cache is full, then inserts."""
    if key in policy:
        policy.touch([key])
        return
    if len(policy) == policy.capacity:
        assert policy.evict(1, protected) is not None
    policy.insert(key, 0)


ArcClass = Callable[[int], Any]


@pytest.fixture
def arc_class() -> ArcClass:
    """ARC on its compiled core, the only one (the plain rendering is the tests' reference)."""
    return ARCPolicy


class TestARC:
    def test_scan_does_not_flush_a_frequent_set(self, arc_class: ArcClass) -> None:
        hot = [f"hot{i}" for i in range(4)]
        scan = [f"scan{i}" for i in range(200)]
        survivors = {}
        for name in ("arc", "lru"):
            policy = arc_class(10) if name == "arc" else create_policy(name, 10)
            for _ in range(3):
                for key in hot:
                    _use(policy, key)
            for key in scan:  # each scanned key is used once, never again
                _use(policy, key)
            survivors[name] = sum(key in policy for key in hot)
        assert survivors["arc"] == 4  # ARC keeps the frequently used set in T2
        assert survivors["lru"] == 0  # while the same scan flushes LRU (the test can fail)

    def test_ghost_hit_in_b1_grows_target_and_b2_shrinks_it(self, arc_class: ArcClass) -> None:
        policy: ARCPolicy[str, int] = arc_class(4)
        for key in "abcd":
            policy.insert(key, 0)
        policy.touch(["c", "d"])  # T1 = a b, T2 = c d
        assert policy.evict(1, ()) == [("a", 0)]  # |T1| = 2 > p = 0: from T1, into B1
        assert policy.lists() == (["b"], ["c", "d"], ["a"], [])
        policy.insert("a", 1)  # a ghost hit in B1: p += max(|B2|/|B1|, 1) = 1; "a" goes to T2
        assert policy.p == 1.0
        assert policy.lists() == (["b"], ["c", "d", "a"], [], [])
        assert policy.evict(1, ()) == [("c", 0)]  # |T1| = 1 is not > p = 1: from T2, into B2
        policy.insert("e", 0)  # an unknown key goes to T1
        assert policy.evict(1, ()) == [("b", 0)]  # |T1| = 2 > p: from T1, into B1
        assert policy.lists() == (["e"], ["d", "a"], ["b"], ["c"])
        policy.insert("c", 2)  # a ghost hit in B2: p -= max(|B1|/|B2|, 1) = 1
        assert policy.p == 0.0
        assert policy.lists() == (["e"], ["d", "a", "c"], ["b"], [])

    def test_target_grows_faster_when_b2_is_larger(self, arc_class: ArcClass) -> None:
        policy: ARCPolicy[str, int] = arc_class(4)
        policy.insert_many(list("abcd"), [0] * 4)
        policy.touch(list("abc"))  # T1 = d, T2 = a b c
        policy.p = 2.0
        assert [k for k, _ in policy.evict(3, ())] == ["a", "b", "c"]  # |T1| = 1 <= p: T2
        policy.insert_many(["x", "y"], [0, 0])
        assert [k for k, _ in policy.evict(1, {"x", "y"})] == ["d"]  # |T1| = 3 > p: T1's LRU
        assert policy.lists()[2:] == (["d"], ["a", "b", "c"])
        policy.insert("d", 0)  # B1 hit with |B2| = 3, |B1| = 1: p += 3
        assert policy.p == 4.0  # capped at the capacity

    def test_protected_lru_of_t1_falls_back_to_next(self, arc_class: ArcClass) -> None:
        policy: ARCPolicy[str, int] = arc_class(3)
        policy.insert_many(["a", "b", "c"], [0, 1, 2])
        assert policy.evict(1, {"a"}) == [("b", 1)]
        assert policy.lists() == (["a", "c"], [], ["b"], [])

    def test_directory_bounds_hold_under_random_use(self, arc_class: ArcClass) -> None:
        rng = random.Random(7)
        c = 20
        policy: ARCPolicy[str, int] = arc_class(c)
        for _ in range(20000):
            key = f"k{int(rng.paretovariate(1.2)) % 120}"
            _use(policy, key)
            t1, t2, b1, b2 = policy.lists()
            assert len(t1) + len(t2) <= c
            assert len(t1) + len(b1) <= c
            assert len(t1) + len(t2) + len(b1) + len(b2) <= 2 * c
            assert 0.0 <= policy.p <= c
            assert not set(t1 + t2) & set(b1 + b2)

    def test_clear_resets_target_and_ghosts(self, arc_class: ArcClass) -> None:
        policy: ARCPolicy[str, int] = arc_class(2)
        policy.insert_many(["a", "b"], [0, 0])
        policy.evict(1, ())
        policy.insert("a", 0)
        assert policy.p > 0
        policy.clear()
        assert policy.p == 0.0 and policy.lists() == ([], [], [], [])


class TestCompiledARC:
    def test_an_install_builds_it_and_arc_runs_on_it(self) -> None:
        assert arc_module._CORE is not None  # `pip install` builds tiering/policies/_arc.c
        policy = create_policy("arc", 4)
        assert isinstance(policy, ARCPolicy) and isinstance(policy._core, arc_module._CORE)

    def test_without_it_arc_is_refused_with_one_line(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """An install without the compiled core (no C compiler) refuses `arc` when the config
        is read, with one line saying what to do, instead of running a second ARC."""
        monkeypatch.setattr(arc_module, "_CORE", None)
        with pytest.raises(ConfigError, match="compiled ARC core") as refused:
            parse_config({"primary": {"eviction": "arc"}})
        assert str(refused.value).startswith("primary.eviction: arc needs")
        assert "\n" not in str(refused.value) and "lru" in str(refused.value)
        with pytest.raises(ConfigError, match="compiled ARC core"):
            ARCPolicy(2)
        assert parse_config({"primary": {"eviction": "lru"}}).primary.eviction == "lru"

    def test_a_call_from_inside_its_own_call_is_refused(self) -> None:
        """A container whose `__contains__` (Python code, run while `evict` holds pointers into
        the lists) calls the policy again gets RuntimeError; the lists stay as they were."""
        policy: ARCPolicy[str, int] = ARCPolicy(4)
        policy.insert_many(list("abcd"), [0, 1, 2, 3])
        errors = []

        class Meddling:
            def __contains__(self, key: object) -> bool:
                try:
                    policy.remove("b")
                except RuntimeError as e:
                    errors.append(str(e))
                return key == "a"

        assert policy.evict(2, Meddling()) == [("b", 1), ("c", 2)]
        assert errors and "called again from inside" in errors[0]
        assert policy.lists() == (["a", "d"], [], ["b", "c"], [])

    def test_values_and_keys_are_released(self) -> None:
        """Evictions, ghost trims, removals and `clear` drop their references: nothing leaks."""
        import sys

        value = object()
        keys = [f"key-{i}" for i in range(100)]
        before = sys.getrefcount(value), [sys.getrefcount(k) for k in keys]
        policy: ARCPolicy[str, object] = ARCPolicy(10)
        for start in range(0, 100, 5):
            batch = keys[start : start + 5]
            if len(policy) + len(batch) > 10:
                victims = policy.evict(len(policy) + len(batch) - 10, ())
                assert victims is not None
                del victims
            policy.insert_many(batch, [value] * len(batch))
            policy.touch(keys[start : start + 2])
        del batch
        policy.remove(policy.lists()[1][0])
        policy.clear()
        assert (sys.getrefcount(value), [sys.getrefcount(k) for k in keys]) == before

    def test_inserting_a_resident_key_is_misuse(self) -> None:
        policy: ARCPolicy[str, int] = ARCPolicy(4)
        policy.insert("a", 0)
        with pytest.raises(ValueError, match="already resident"):
            policy.insert_many(["a"], [1])
        with pytest.raises(ValueError, match="as many values as keys"):
            policy.insert_many(["b", "c"], [1])
        with pytest.raises(ValueError, match="at least 0"):
            policy.evict(-1, ())


class TestARCAgainstReference:
    """`ARCPolicy` is written for speed; `ReferenceARC` is the plain version it replaced. Driven
    by the same calls, both must return the same victims and hold the same lists and target."""

    @staticmethod
    def assert_same(fast: ARCPolicy[str, int], ref: ReferenceARC[str, int]) -> None:
        assert fast.lists() == ref.lists()
        assert fast.p == ref.p
        assert len(fast) == len(ref)

    @pytest.mark.parametrize("seed", range(12))
    def test_random_calls(self, seed: int, arc_class: ArcClass) -> None:
        rng = random.Random(seed)
        c = rng.choice([1, 2, 3, 7, 16, 40])
        fast: ARCPolicy[str, int] = arc_class(c)
        ref: ReferenceARC[str, int] = ReferenceARC(c)
        universe = [f"k{i}" for i in range(5 * c + 4)]
        values = iter(range(10**9))

        def some_keys(k: int) -> list[str]:
            # Skewed, so that keys come back: hits, ghost hits in B1 and B2, and new keys.
            return [
                universe[min(int(rng.expovariate(4 / len(universe))), len(universe) - 1)]
                for _ in range(k)
            ]

        for _ in range(3000):
            t1, t2, _, _ = ref.lists()
            resident = t1 + t2
            protected = set(rng.sample(resident, rng.randint(0, len(resident)) // 3))
            op = rng.random()
            if op < 0.5:  # the pool's store: evict the shortfall, then insert the new keys
                batch = list(
                    dict.fromkeys(k for k in some_keys(rng.randint(1, 2 * c)) if k not in ref)
                )[:c]
                shortfall = len(batch) - (c - len(ref))
                if shortfall > 0:
                    victims = ref.evict(shortfall, protected)
                    assert fast.evict(shortfall, protected) == victims
                    if victims is None:
                        continue
                vals = [next(values) for _ in batch]
                if len(batch) == 1 and rng.random() < 0.5:
                    fast.insert(batch[0], vals[0])
                    ref.insert(batch[0], vals[0])
                else:
                    fast.insert_many(batch, vals)
                    ref.insert_many(batch, vals)
            elif op < 0.8:  # uses, with repeats and keys that are not resident
                keys = some_keys(rng.randint(0, c + 2))
                fast.touch(iter(keys))
                ref.touch(keys)
            elif op < 0.9:  # a reclaim: evict without inserting
                n = rng.randint(0, len(resident) + 1)
                assert fast.evict(n, protected) == ref.evict(n, protected)
            elif op < 0.995:
                if resident:
                    key = rng.choice(resident)
                    assert fast.remove(key) == ref.remove(key)
            else:
                fast.clear()
                ref.clear()
            self.assert_same(fast, ref)
            for key in some_keys(3):
                assert fast.get(key) == ref.get(key)
                assert (key in fast) == (key in ref)

    def test_trace_replay_through_the_pool(self, arc_class: ArcClass) -> None:
        """The start of the Mooncake trace through `PrimaryPool`, driven as vLLM's connector
        drives it (as `bench/manager.py` does), at a capacity where both ghost lists fill and
        the target moves."""
        trace = load_trace(ROOT / "bench" / "traces" / "mooncake_conversation_trace.jsonl.gz")
        requests = trace_keys(trace.requests[:6000])
        fast: ARCPolicy[BlockKey, int] = arc_class(3276)
        ref: ReferenceARC[BlockKey, int] = ReferenceARC(3276)
        pools = PrimaryPool(3276, fast), PrimaryPool(3276, ref)  # type: ignore[arg-type]
        hits, targets = 0, set()
        for keys in requests:
            answers = []
            for pool in pools:
                n = 0
                while n < len(keys) and pool.lookup(keys[n]) is LookupResult.HIT:
                    n += 1
                slots = pool.prepare_load(keys[:n])
                grant = pool.prepare_store(keys[n:])
                assert grant is not None
                pool.complete_store(grant.keys)
                pool.complete_load(keys[:n])
                answers.append((n, slots, grant))
            assert answers[0] == answers[1]
            hits += answers[0][0]
            targets.add(fast.p)
        assert fast.lists() == ref.lists() and fast.p == ref.p
        assert hits > 0 and len(targets) > 50  # hits, and ghost hits that moved the target
