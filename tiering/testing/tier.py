"""The conformance suite every tier inherits (pytest), shipped for authors of backends.

    import contextlib

    from tiering.testing import NAMESPACE
    from tiering.testing.tier import TierConformance

    class TestMyTier(TierConformance):
        @pytest.fixture
        def make_tier(self, tmp_path):
            def make(**options):           # a fresh tier object on the same storage each call
                return MyTier(namespace=NAMESPACE, root=tmp_path, **options)
            return make

        @pytest.fixture
        def store_down(self, server):      # the store unreachable inside the block
            @contextlib.contextmanager
            def down(tier):
                server.stop()
                yield
                server.start()
            return down

        async def raw_put(self, tier, key, blob): ...   # store object bytes, bypassing `tier`
        async def raw_get(self, tier, key): ...         # stored object bytes or None, likewise

The hooks are described, and checked when the class is defined, in `tiering.testing.hooks`; a
test class that lacks one fails with the name of the missing hook. Tests of a capability a tier
does not declare (eviction, listing, an index, a store shared by two instances) skip with the
reason. `TierConformance` is made of sections, one module each:

- `tiering.testing.contract` (`ContractTests`): round trips, batches, read-only mode,
  concurrency, capabilities, random calls against a dict model (`tiering.testing.stateful`);
- `tiering.testing.attacks` (`AttackTests`): what a stranger with write access to the store can
  plant (`tiering.testing.crafted`): lying headers, compression bombs, objects far larger than
  any block, objects without a valid MAC; each a counted miss in bounded memory;
- `tiering.testing.sealed` (`SealTests`): sealed and encrypted objects (`auth.secret`,
  `auth.encrypt`): a bit flipped anywhere, a grafted header, a cut tag, a wrong key are misses,
  and an encrypted object keeps no block in the clear;
- `tiering.testing.index` (`IndexTests`): an `indexed` tier's `knows` and `newest` tell the
  truth about its store;
- `tiering.testing.faults` (`FaultTests`): a store that is down is `TierUnavailable`.

Every test's body is a coroutine run on its own `asyncio.run` loop (`tiering.testing.hooks.
asynctest`).
"""

from __future__ import annotations

from tiering.testing.attacks import AttackTests
from tiering.testing.contract import ContractTests
from tiering.testing.faults import FaultTests
from tiering.testing.hooks import MakeTier, StoreDown, TierHooks, asynctest
from tiering.testing.index import IndexTests
from tiering.testing.sealed import SealTests

__all__ = ["MakeTier", "StoreDown", "TierConformance", "TierHooks", "asynctest"]


class TierConformance(ContractTests, AttackTests, SealTests, IndexTests, FaultTests):
    """The behaviour every tier must show, run by pytest in the test process (each test's body
    on its own `asyncio.run` loop, the tier's thread). Subclasses provide the hooks of
    `TierHooks`: `make_tier`, `store_down`, `raw_put` and `raw_get`."""
