"""The hooks a backend's test class provides to the conformance suite, and `asynctest` (pytest).

A backend's test class subclasses `tiering.testing.tier.TierConformance` and provides four hooks,
all abstract here, so a class that forgets one fails at import with the names of the missing
ones (pytest would otherwise skip an abstract class without a word):

- `make_tier` (a fixture): `make(**options)` makes a fresh tier object on the same storage at
  each call; it is called inside the test's event loop (tiers may bind to it), with the options
  `capacity`, `read_only`, `codec`, `secret` and `namespace` (which wins over the fixture's own);
- `store_down` (a fixture): `store_down(tier)` is a context manager inside which the tier's store
  is unreachable (the server stopped, the directory taken away) and after which it is back; a
  tier whose store cannot go down (a dict in the process) skips with the reason;
- `raw_put(tier, key, blob)` and `raw_get(tier, key)`: store object bytes under the name `tier`
  gives `key` (in `tier.namespace`), and read them back (None when absent), bypassing `tier`,
  the way a stranger would (a plain file write, a raw Redis SET, a raw S3 PUT), so nothing
  planted goes through the code under test.

`raw_put_large` has a default (the object written in full); a store that can make a large object
cheaply (a sparse file) overrides it and raises `large_object_bytes`.
"""

from __future__ import annotations

import asyncio
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine
from contextlib import AbstractContextManager
from typing import Any, ParamSpec

import pytest

from tiering.keys import BlockKey
from tiering.testing.crafted import LARGE_OBJECT
from tiering.tier import Tier

__all__ = ["MakeTier", "StoreDown", "TierHooks", "asynctest"]

MakeTier = Callable[..., Tier]
"""`make_tier(**options)`: a fresh tier object on the same storage at each call."""
StoreDown = Callable[[Tier], AbstractContextManager[object]]
"""`store_down(tier)`: a context manager inside which the tier's store is unreachable."""

P = ParamSpec("P")

HOOKS = ("make_tier", "store_down", "raw_put", "raw_get")


def asynctest(test: Callable[P, Coroutine[Any, Any, None]]) -> Callable[P, None]:
    """A suite test written as a coroutine, run by pytest as a plain test: each call on its own
    `asyncio.run` loop (the tier's thread); fixtures and parameters pass through."""

    @functools.wraps(test)
    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


class TierHooks(ABC):
    """What the suite's tests (test process, each on its own `asyncio.run` loop) ask of a
    backend's test class: the hooks above, and the store's shape as class attributes."""

    large_object_bytes = LARGE_OBJECT
    """The size `raw_put_large` is asked for (a subclass with sparse files asks for more)."""
    one_writer = False
    """The store takes one writable tier at a time (the file tier's segment layout): tests of
    two tiers on one store open the second read-only."""
    writes_behind = False
    """A put is held in memory and written later with others (S3 packs): with the store down,
    a put may be accepted rather than refused."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.__name__.startswith("Test"):
            return  # a shared base of several test classes (hooks for one store, many layouts)
        missing = [h for h in HOOKS if getattr(getattr(cls, h, None), "__isabstractmethod__", 0)]
        if missing:
            raise TypeError(
                f"{cls.__qualname__} does not provide the conformance hook(s) "
                f"{', '.join(missing)}: see tiering.testing.hooks"
            )

    @pytest.fixture
    @abstractmethod
    def make_tier(self) -> MakeTier:
        """A fixture (it may ask for others: a server, `tmp_path`) answering `make(**options)`,
        a fresh tier object on the same storage at each call."""

    @pytest.fixture
    @abstractmethod
    def store_down(self) -> StoreDown:
        """A fixture answering `store_down(tier)`: a context manager inside which `tier`'s store
        cannot be reached, and after which it can again. `pytest.skip(reason)` where the store
        cannot go down."""

    @abstractmethod
    async def raw_put(self, tier: Tier, key: BlockKey, blob: bytes) -> None:
        """Store `blob` as the object of `key`, as it is, bypassing `tier`."""

    @abstractmethod
    async def raw_get(self, tier: Tier, key: BlockKey) -> bytes | None:
        """The object bytes stored for `key`, unverified, bypassing `tier`; None when absent."""

    async def raw_put_large(self, tier: Tier, key: BlockKey, head: bytes, size: int) -> None:
        """Store an object of `size` bytes that starts with `head` (zeros after it), bypassing
        `tier`. Override where the store can make one cheaply (a sparse file)."""
        await self.raw_put(tier, key, head + bytes(size - len(head)))
