"""The memory tier against the shipped conformance suite, plus the tier base and registry."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.tiers.memory_hooks import WriteOnceMemoryTier, plant, stored
from tiering.errors import ConfigError, MissingDependencyError, UnknownNameError
from tiering.keys import BlockKey
from tiering.registry import get_tier_class, register_tier, tier_types
from tiering.testing import NAMESPACE, key
from tiering.testing.tier import MakeTier, StoreDown, TierConformance
from tiering.tier import Tier
from tiers.memory import MemoryTier


class TestMemoryTier(TierConformance):
    @pytest.fixture
    def make_tier(self) -> MakeTier:
        def make(**options: Any) -> Tier:
            return MemoryTier(**{"namespace": NAMESPACE, **options})

        return make

    @pytest.fixture
    def store_down(self) -> StoreDown:
        pytest.skip("memory: the store is the tier's own dict, which cannot go down")

    async def raw_put(self, tier: Tier, key: BlockKey, blob: bytes) -> None:
        plant(tier, key, blob)

    async def raw_get(self, tier: Tier, key: BlockKey) -> bytes | None:
        return stored(tier, key)


class TestRegistry:
    def test_builtin_types(self) -> None:
        assert {"memory", "file", "redis", "s3"} <= set(tier_types())
        assert get_tier_class("memory") is MemoryTier
        assert isinstance(get_tier_class("memory")(namespace=NAMESPACE, capacity=10), MemoryTier)

    def test_unknown_type(self) -> None:
        with pytest.raises(
            UnknownNameError,
            match=r"unknown tier type 'rediss' \(did you mean 'redis'\?\); known: .*file, memory",
        ):
            get_tier_class("rediss")

    def test_missing_package_says_what_to_install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import sys

        monkeypatch.setitem(sys.modules, "redis", None)  # as if redis-py were not installed
        for name in [m for m in sys.modules if m == "tiers.redis" or m.startswith("tiers.redis.")]:
            monkeypatch.delitem(sys.modules, name)  # the package and its modules, imported afresh
        with pytest.raises(
            MissingDependencyError,
            match=r"tier type 'redis' needs the redis package: pip install kvtier\[redis\]",
        ):
            get_tier_class("redis")

    def test_bad_options_name_the_tier_and_its_type(self) -> None:
        from tiering.config import parse_config, tier_from_config

        config = parse_config({"tiers": [{"name": "m", "type": "memory"}]})
        with pytest.raises(
            ConfigError,
            match=r"tier 'm' \(memory\): colour: unknown option; expected one of capacity",
        ):
            tier_from_config(config.tiers[0], NAMESPACE, config, colour="blue")
        with pytest.raises(ConfigError, match=r"tier 'm' \(memory\): codec: expected one of"):
            tier_from_config(config.tiers[0], NAMESPACE, config, codec="gzip")
        with pytest.raises(ConfigError, match="codec: expected one of raw, lz4"):
            MemoryTier(namespace=NAMESPACE, codec="gzip")

    def test_register_a_custom_type(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import tiering.registry as registry

        monkeypatch.setattr(registry.TIERS, "_table", dict(registry.TIERS._table))
        register_tier("ram", MemoryTier)
        register_tier("ram2", "tiers.memory:MemoryTier")
        assert get_tier_class("ram") is MemoryTier and get_tier_class("ram2") is MemoryTier
        with pytest.raises(ConfigError, match="already registered"):
            register_tier("memory", MemoryTier)
        register_tier("bad", "collections:OrderedDict")
        with pytest.raises(ConfigError, match="is not a Tier subclass"):
            get_tier_class("bad")


def test_a_put_the_store_already_held_is_counted_as_a_duplicate() -> None:
    """A backend that writes once answers False from `_write` when the key was there: the
    put succeeds, and the base counts it under `duplicates` and `duplicate_bytes`, not
    `bytes_written`."""

    async def body() -> None:
        async with WriteOnceMemoryTier(namespace=NAMESPACE) as tier:
            await tier.put(key(1), b"x" * 100)
            await tier.put(key(1), b"x" * 100)
            await tier.put_many([(key(1), b"x" * 100), (key(2), b"y" * 50)])
            assert tier.counters["puts"] == 4
            assert tier.counters["duplicates"] == 2
            assert tier.counters["duplicate_bytes"] == 200
            assert tier.counters["bytes_written"] == 150

    asyncio.run(body())
