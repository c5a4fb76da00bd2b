"""The conformance suite's hooks: a backend's test class that lacks one fails with its name."""

from __future__ import annotations

import inspect

import pytest

from tiering.keys import BlockKey
from tiering.testing.tier import MakeTier, TierConformance
from tiering.tier import Tier


def test_a_test_class_without_a_hook_fails_with_the_hooks_name() -> None:
    with pytest.raises(TypeError, match=r"TestForgetful does not .* hook\(s\) store_down, raw_get"):

        class TestForgetful(TierConformance):
            @pytest.fixture
            def make_tier(self) -> MakeTier:
                raise AssertionError("never called")

            async def raw_put(self, tier: Tier, key: BlockKey, blob: bytes) -> None:
                raise AssertionError("never called")


def test_a_shared_base_may_leave_hooks_to_its_subclasses() -> None:
    """A base of several test classes (one store's hooks, many layouts) is not a test class:
    it stays abstract, and pytest does not collect it."""

    class StoreHooks(TierConformance):
        async def raw_get(self, tier: Tier, key: BlockKey) -> bytes | None:
            return None

    assert inspect.isabstract(StoreHooks)
    assert {"make_tier", "store_down", "raw_put"} <= StoreHooks.__abstractmethods__
