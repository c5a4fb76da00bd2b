"""What kvtier ships for testing tiers and policies, backends' authors included.

This package imports no pytest: it re-exports the plain data and tools below. The suites, which
need pytest, are its modules:

- `tiering.testing.tier`: `TierConformance`, the conformance suite every tier inherits, made
  of `tiering.testing.hooks` (what a backend's test class provides, `asynctest`),
  `tiering.testing.contract`, `tiering.testing.attacks`, `tiering.testing.index` and
  `tiering.testing.faults`;
- `tiering.testing.policies`: `PolicyContract`, the eviction-policy contract;
- `tiering.testing.stateful`: `TierStateMachine`, random calls against a dict model (Hypothesis),
  run by the suite;
- `tiering.testing.crafted`: the objects a stranger with write access to a store can plant
  (pytest-free, re-exported here);
- `tiering.testing.data`: namespaces, keys and payloads (pytest-free, re-exported here).
"""

from tiering.testing.crafted import PEAK_BYTES, craft, peak_memory
from tiering.testing.data import NAMESPACE, OTHER_NAMESPACE, OTHER_SECRET, SECRET, key, payload

__all__ = [
    "NAMESPACE",
    "OTHER_NAMESPACE",
    "OTHER_SECRET",
    "PEAK_BYTES",
    "SECRET",
    "craft",
    "key",
    "payload",
    "peak_memory",
]
