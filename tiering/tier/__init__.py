"""The secondary tier: what a backend author imports (`from tiering.tier import Tier, TierStat`).

A backend subclasses `Tier`, writes the primitives of the contract and declares its options as a
`TierOptions` record; the base does the rest. Each concern is a module of this package:

- `contract`: the primitives a backend writes, its capabilities, what the base guarantees it;
- `base`: `Tier`, the public data path over those primitives;
- `values`: the values a tier answers (`TierStat`, `ObjectInfo`, `NamespaceUsage`, `Medium`);
- `options`: typed options records (`TierOptions`, `option`), which the configuration's sections
  use too (`tiering.options` is the same module's documented path);
- `format`: the on-tier object format (header, codecs, checksums, MAC);
- `envelope`: a tier's objects sealed and opened with its codec, checksum and secret;
- `batching`: bounded concurrency and the optional batch primitives;
- `counters`: the names of the events a tier counts;
- `refusals`: names refused moments ago, a fast miss;
- `records`: small named objects beside the blocks (a warm-start manifest);
- `operators`: the operators' calls (listings, usage, raw objects);
- `usage`: store-wide usage added up per namespace, within a bound;
- `wrappers`: forwarding and fault-injecting tiers.
"""

from tiering.tier.base import Tier
from tiering.tier.batching import ReadsMany, WritesMany
from tiering.tier.contract import ReadsInto
from tiering.tier.envelope import MIN_SECRET_BYTES, Envelope
from tiering.tier.values import (
    HEADER_ROOM,
    Buffer,
    KeyLike,
    Medium,
    NamespaceUsage,
    ObjectInfo,
    TierStat,
    as_key,
)

__all__ = [
    "HEADER_ROOM",
    "MIN_SECRET_BYTES",
    "Buffer",
    "Envelope",
    "KeyLike",
    "Medium",
    "NamespaceUsage",
    "ObjectInfo",
    "ReadsInto",
    "ReadsMany",
    "Tier",
    "TierStat",
    "WritesMany",
    "as_key",
]
