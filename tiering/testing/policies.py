"""The eviction-policy contract as a pytest mixin, shipped for authors of custom policies.

    from tiering.testing.policies import PolicyContract

    class TestMyPolicy(PolicyContract):
        @pytest.fixture
        def make_policy(self):
            return MyPolicy          # called as make_policy(capacity)

Every test drives the policy the way `PrimaryPool` does: it never inserts a resident key and
never holds more keys than the capacity.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from tiering.policies.base import EvictionPolicy

__all__ = ["PolicyContract"]

MakePolicy = Callable[[int], EvictionPolicy[str, int]]


class PolicyContract:
    """Behaviour every eviction policy must show (the docstring of `EvictionPolicy`), run by
    pytest in the test process, on one thread as the scheduler runs a policy."""

    @pytest.fixture
    def make_policy(self) -> MakePolicy:
        raise NotImplementedError("a PolicyContract subclass provides the make_policy fixture")

    def fill(self, policy: EvictionPolicy[str, int], n: int, prefix: str = "k") -> list[str]:
        keys = [f"{prefix}{i}" for i in range(n)]
        for i, key in enumerate(keys):
            policy.insert(key, i)
        return keys

    def test_insert_get_contains_len(self, make_policy: MakePolicy) -> None:
        policy = make_policy(4)
        assert len(policy) == 0 and "a" not in policy and policy.get("a") is None
        policy.insert("a", 10)
        policy.insert("b", 11)
        assert len(policy) == 2
        assert "a" in policy and policy.get("a") == 10 and policy.get("b") == 11
        assert policy.get("c") is None

    def test_get_is_not_a_use(self, make_policy: MakePolicy) -> None:
        policy = make_policy(3)
        keys = self.fill(policy, 3)
        policy.get(keys[0])
        assert [k for k, _ in policy.evict(1, set()) or []] == [keys[0]]

    def test_insert_many_equals_inserts(self, make_policy: MakePolicy) -> None:
        one, many = make_policy(8), make_policy(8)
        keys = [f"k{i}" for i in range(8)]
        for i, key in enumerate(keys):
            one.insert(key, i)
        many.insert_many(keys, list(range(8)))
        assert one.evict(8, set()) == many.evict(8, set())

    def test_remove_returns_value(self, make_policy: MakePolicy) -> None:
        policy = make_policy(4)
        self.fill(policy, 3)
        assert policy.remove("k1") == 1
        assert "k1" not in policy and len(policy) == 2
        assert sorted(k for k, _ in policy.evict(2, set()) or []) == ["k0", "k2"]

    def test_evict_returns_values_and_drops_keys(self, make_policy: MakePolicy) -> None:
        policy = make_policy(5)
        self.fill(policy, 5)
        victims = policy.evict(2, set())
        assert victims is not None and len(victims) == 2
        for key, value in victims:
            assert key not in policy and value == int(key[1:])
        assert len(policy) == 3

    def test_evict_zero(self, make_policy: MakePolicy) -> None:
        policy = make_policy(2)
        self.fill(policy, 2)
        assert policy.evict(0, set()) == []
        assert len(policy) == 2

    def test_evict_without_use_is_insertion_order(self, make_policy: MakePolicy) -> None:
        policy = make_policy(6)
        keys = self.fill(policy, 6)
        assert [k for k, _ in policy.evict(6, set()) or []] == keys

    def test_touched_key_outlives_untouched(self, make_policy: MakePolicy) -> None:
        policy = make_policy(4)
        keys = self.fill(policy, 4)
        policy.touch([keys[0]])
        victims = [k for k, _ in policy.evict(3, set()) or []]
        assert keys[0] not in victims
        assert keys[0] in policy

    def test_touch_ignores_absent_keys(self, make_policy: MakePolicy) -> None:
        policy = make_policy(2)
        self.fill(policy, 2)
        policy.touch(["nope", "k1", "gone"])
        assert len(policy) == 2 and "nope" not in policy

    def test_evict_skips_protected(self, make_policy: MakePolicy) -> None:
        policy = make_policy(5)
        keys = self.fill(policy, 5)
        protected = {keys[0], keys[2]}
        victims = policy.evict(3, protected)
        assert victims is not None
        assert {k for k, _ in victims} == {keys[1], keys[3], keys[4]}
        assert all(k in policy for k in protected)

    def test_evict_is_atomic_when_too_few_unprotected(self, make_policy: MakePolicy) -> None:
        policy = make_policy(4)
        keys = self.fill(policy, 4)
        assert policy.evict(3, {keys[1], keys[3]}) is None
        assert policy.evict(5, set()) is None
        assert len(policy) == 4 and all(k in policy for k in keys)
        assert {k for k, _ in policy.evict(4, set()) or []} == set(keys)

    def test_evict_everything_protected(self, make_policy: MakePolicy) -> None:
        policy = make_policy(3)
        keys = self.fill(policy, 3)
        assert policy.evict(1, set(keys)) is None
        assert len(policy) == 3

    def test_removed_key_can_return(self, make_policy: MakePolicy) -> None:
        policy = make_policy(3)
        self.fill(policy, 3)
        policy.remove("k0")
        policy.insert("k0", 99)
        assert policy.get("k0") == 99 and len(policy) == 3

    def test_evicted_key_can_return(self, make_policy: MakePolicy) -> None:
        policy = make_policy(3)
        self.fill(policy, 3)
        ((victim, _),) = policy.evict(1, set()) or []
        policy.insert(victim, 42)
        assert policy.get(victim) == 42 and len(policy) == 3

    def test_clear(self, make_policy: MakePolicy) -> None:
        policy = make_policy(3)
        self.fill(policy, 3)
        policy.evict(2, set())
        policy.clear()
        assert len(policy) == 0 and "k2" not in policy
        self.fill(policy, 3)
        assert [k for k, _ in policy.evict(3, set()) or []] == ["k0", "k1", "k2"]

    def test_random_operations_keep_residency_consistent(self, make_policy: MakePolicy) -> None:
        """Against a set model: residency, values and counts after thousands of mixed calls."""
        rng = random.Random(1234)
        capacity = 16
        policy = make_policy(capacity)
        model: dict[str, int] = {}
        for step in range(5000):
            op = rng.random()
            key = f"k{rng.randrange(48)}"
            if op < 0.45:
                if key in model:
                    continue
                if len(model) == capacity:
                    protected = set(rng.sample(sorted(model), rng.randrange(4)))
                    victims = policy.evict(1, protected)
                    assert victims is not None
                    ((victim, value),) = victims
                    assert victim not in protected and model.pop(victim) == value
                policy.insert(key, step)
                model[key] = step
            elif op < 0.75:
                policy.touch(rng.sample(sorted(model) + [key], min(3, len(model) + 1)))
            elif op < 0.85 and key in model:
                assert policy.remove(key) == model.pop(key)
            else:
                n = rng.randrange(4)
                protected = {k for k in model if rng.random() < 0.5}
                victims = policy.evict(n, protected)
                if n > len(model) - len(protected):
                    assert victims is None
                else:
                    assert victims is not None and len(victims) == n
                    for victim, value in victims:
                        assert victim not in protected and model.pop(victim) == value
            assert len(policy) == len(model)
            for k, v in model.items():
                assert policy.get(k) == v
