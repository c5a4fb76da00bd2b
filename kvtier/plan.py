"""`kvtier plan`'s model: a request trace through the real primary pool and its policy, and a
secondary tier per configured one, for a sweep of sizes (any thread: plain computation).

Semantics as `kvtier.replay` (requests in file order, prefix hits, the first half warms, the
second is measured), with the hierarchy behind the primary: a block not in the primary is looked
for in each tier in order, and the prefix goes on while some layer holds the block; the layer
that served each hit is counted. Blocks found in a tier are promoted into the primary (stored
there, evicting by its policy, as the manager's promotions do). A tier written `through`
receives every block the primary stores for the first time; a tier written `back` receives the
blocks the primary evicts (`selective`: those hit at least `admit_after_hits` times while
there). A tier evicts its least recently *used* block first when its medium can tell use
(memory, a files directory: a hit refreshes the file's mtime, Redis's `allkeys-lru`, an S3
prefix's sweeper with the engines' records of reads: a read or a write that finds the block
refreshes it), else its oldest *written* (an S3 tier configured with `reads_interval: 0`, whose
sweeper then goes by `LastModified`): `MEDIUM_ORDER`, `Layer.order`. A tier holds whole blocks:
its capacity in blocks is its bytes over a block's KV bytes (`BLOCK_TOKENS` tokens of
`token_bytes` each).

A fleet (`plan_fleet`): N engines, each with a primary of its own, over one shared tier, is
not modelled here but replayed by `kvtier replay --engines`'s code (`kvtier.fleet.replay_fleet`:
the real managers and the shared tier's real medium, sized in the blocks it holds), one
configuration at a time: what `kvtier plan --engines` reports for a shared tier is that replay's.

What a hit buys is priced per configuration: the prompt tokens not recomputed, the prefill time
that saves at `prefill_rate` tokens per second, and the time the hits cost to load from their
layer at its bandwidth (given, or `kvtier bench`'s measurement of the tier).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from kvtier.trace import BLOCK_TOKENS, TraceRequest, trace_keys
from tiering.config import Config, TierConfig
from tiering.keys import BlockKey
from tiering.primary import LookupResult, PrimaryPool

__all__ = [
    "DEFAULT_BANDWIDTH",
    "MEDIUM_ORDER",
    "PREFILL_RATE",
    "PRIMARY",
    "TOKEN_BYTES",
    "Layer",
    "PlanResult",
    "Pricing",
    "TierModel",
    "blocks_of",
    "order_of",
    "plan",
    "plan_fleet",
    "run_plan",
]

PRIMARY: Final = "primary"
MEDIUM_ORDER: Final = {"memory": "use", "file": "use", "redis": "use", "s3": "use"}
"""What each medium's eviction goes by (module docstring), unless a layer says (`Layer.order`)."""
TOKEN_BYTES: Final = 131072
"""KV bytes per token by default: Llama-3-8B in 16 bits (32 layers x 8 KV heads x 128 x 2 (K,
V) x 2 bytes)."""
PREFILL_RATE: Final = 10000.0
"""Prompt tokens per second one engine prefills, by default (an 8B model on one H100)."""
DEFAULT_BANDWIDTH: Final = {
    PRIMARY: 20.0,
    "memory": 10.0,
    "file": 3.0,
    "redis": 1.0,
    "s3": 0.3,
}
"""GB/s a hit loads at when not given or measured: pinned host memory over PCIe, another host
memory, an NVMe drive, Redis over a 10 GbE link, S3 from one client. Assumptions to replace:
`--bandwidth NAME=GB/s`, or `--measure`."""


@dataclass(frozen=True, slots=True)
class Layer:
    """A secondary tier of one configuration: its name, medium, write mode and blocks."""

    name: str
    medium: str
    blocks: int
    write: str = "through"
    admit_after_hits: int = 2
    """With `write: selective`: the hits in the primary a block needs before an eviction
    writes it to this tier."""
    order: str | None = None
    """"use" or "write" (`order_of`); None: the medium's (`MEDIUM_ORDER`)."""

    @property
    def by_use(self) -> bool:
        return (self.order or MEDIUM_ORDER.get(self.medium, "use")) == "use"


def order_of(tier: TierConfig) -> str | None:
    """What a configured tier's eviction goes by where its options change its medium's: an S3
    tier with `reads_interval: 0` keeps no record of reads, so its sweeper goes by write
    order; None: the medium's."""
    if tier.type == "s3" and tier.options.get("reads_interval", 1) == 0:
        return "write"
    return None


class TierModel:
    """A tier holding `capacity` blocks, evicting by use or by write order (`Layer.by_use`)."""

    def __init__(self, layer: Layer) -> None:
        self.layer = layer
        self._blocks: OrderedDict[BlockKey, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def hit(self, key: BlockKey) -> bool:
        if key not in self._blocks:
            return False
        if self.layer.by_use:
            self._blocks.move_to_end(key)
        return True

    def write(self, key: BlockKey) -> None:
        if key in self._blocks:
            if self.layer.by_use:  # a write that finds the block refreshes it, as a hit does
                self._blocks.move_to_end(key)
            return
        if self.layer.blocks <= 0:
            return
        self._blocks[key] = None
        while len(self._blocks) > self.layer.blocks:
            self._blocks.popitem(last=False)


@dataclass(frozen=True, slots=True)
class Pricing:
    """What a hit is worth: KV bytes per token, the prefill rate a miss costs, and each
    layer's load bandwidth in GB/s (by layer name, else by medium)."""

    token_bytes: int = 131072
    """`TOKEN_BYTES` by default."""
    prefill_rate: float = 10000.0
    """Prompt tokens per second one engine prefills (`PREFILL_RATE` by default)."""
    bandwidth: dict[str, float] = field(default_factory=dict)

    def gbps(self, name: str, medium: str) -> float:
        return self.bandwidth.get(name) or DEFAULT_BANDWIDTH.get(medium, 1.0)


@dataclass(frozen=True, slots=True)
class PlanResult:
    """One configuration's outcome over the measured half."""

    primary: int
    policy: str
    layers: tuple[Layer, ...]
    total_tokens: int
    hit_tokens: dict[str, int]
    """Hit tokens by the layer that served them (`PRIMARY`, then each tier's name)."""
    saved_seconds: float
    load_seconds: float

    @property
    def hits(self) -> int:
        return sum(self.hit_tokens.values())

    @property
    def hit_rate(self) -> float:
        return self.hits / self.total_tokens if self.total_tokens else 0.0

    def rate(self, layer: str) -> float:
        return self.hit_tokens.get(layer, 0) / self.total_tokens if self.total_tokens else 0.0

    @property
    def net_seconds(self) -> float:
        return self.saved_seconds - self.load_seconds

    def as_json(self) -> dict[str, Any]:
        return {
            "primary_blocks": self.primary,
            "policy": self.policy,
            "tiers": [
                {"name": t.name, "medium": t.medium, "blocks": t.blocks, "write": t.write}
                for t in self.layers
            ],
            "hit_rate": self.hit_rate,
            "hit_rate_by_layer": {name: self.rate(name) for name in self.hit_tokens},
            "tokens_not_recomputed": self.hits,
            "total_tokens": self.total_tokens,
            "prefill_seconds_saved": round(self.saved_seconds, 3),
            "load_seconds": round(self.load_seconds, 3),
            "net_seconds_saved": round(self.net_seconds, 3),
        }


def plan(
    requests: Sequence[TraceRequest],
    keys: Sequence[Sequence[BlockKey]],
    primary: int,
    policy: str,
    layers: Sequence[Layer],
    pricing: Pricing,
) -> PlanResult:
    """One configuration: `requests` (with their block `keys`, `trace_keys`) through a primary
    pool of `primary` blocks under `policy` and a model of each tier (module docstring)."""
    pool = PrimaryPool(primary, policy)
    tiers = [TierModel(layer) for layer in layers]
    through = [t for t in tiers if t.layer.write == "through"]
    back = [t for t in tiers if t.layer.write != "through"]
    selective = any(t.layer.write == "selective" for t in tiers)
    hits_in_primary: dict[BlockKey, int] = {}
    measured_from = len(requests) // 2
    hit_tokens = {PRIMARY: 0, **{layer.name: 0 for layer in layers}}
    total = 0
    lookup, HIT = pool.lookup, LookupResult.HIT
    for index, (request, blocks) in enumerate(zip(requests, keys, strict=True)):
        served: list[str] = []
        for key in blocks:
            if lookup(key) is HIT:
                served.append(PRIMARY)
                continue
            tier = next((t for t in tiers if t.hit(key)), None)
            if tier is None:
                break
            served.append(tier.layer.name)
        in_primary = [k for k, where in zip(blocks, served, strict=False) if where == PRIMARY]
        if selective:
            for key in in_primary:
                hits_in_primary[key] = hits_in_primary.get(key, 0) + 1
        pool.prepare_load(in_primary)
        new = blocks[len(served) :]
        promoted = [k for k, where in zip(blocks, served, strict=False) if where != PRIMARY]
        grant = pool.prepare_store([*promoted, *new])
        if grant is not None:
            for evicted in grant.evicted:
                hits = hits_in_primary.pop(evicted, 0) if selective else 0
                for tier in back:
                    if tier.layer.write != "selective" or hits >= tier.layer.admit_after_hits:
                        tier.write(evicted)
            pool.complete_store(grant.keys)
        for tier in through:
            for key in new:
                tier.write(key)
        pool.complete_load(in_primary)
        if index >= measured_from:
            tokens = request.block_tokens()
            total += sum(tokens)
            for i, where in enumerate(served):
                hit_tokens[where] += tokens[i]
    saved = sum(hit_tokens.values()) / pricing.prefill_rate
    load = hit_tokens[PRIMARY] * pricing.token_bytes / (pricing.gbps(PRIMARY, PRIMARY) * 1e9)
    for layer in layers:
        gbps = pricing.gbps(layer.name, layer.medium)
        load += hit_tokens[layer.name] * pricing.token_bytes / (gbps * 1e9)
    return PlanResult(primary, policy, tuple(layers), total, hit_tokens, saved, load)


def run_plan(
    requests: Sequence[TraceRequest],
    primaries: Sequence[int],
    policies: Sequence[str],
    tiers: Sequence[tuple[Layer, Sequence[int]]],
    pricing: Pricing,
    progress: Callable[[int], None] | None = None,
) -> list[PlanResult]:
    """Every configuration of the sweep: each policy, each combination of the tiers' sizes
    (`tiers`: each tier and the sizes in blocks it is tried at), each primary size."""
    keys = trace_keys(requests)
    sizes = [[dataclasses.replace(layer, blocks=n) for n in blocks] for layer, blocks in tiers]
    results = []
    for policy in policies:
        for layers in itertools.product(*sizes):
            for primary in primaries:
                results.append(plan(requests, keys, primary, policy, layers, pricing))
                if progress is not None:
                    progress(len(results))
    return results


def plan_fleet(
    requests: Sequence[TraceRequest],
    config: Config,
    engines: int,
    primary: int,
    policy: str,
    shared_blocks: int,
    pricing: Pricing,
    route: str = "sticky",
    seed: int = 0,
    block_bytes: int = 64,
) -> PlanResult:
    """One configuration of a fleet: `engines` engines with `primary` blocks each under
    `policy`, over the one tier of `config` holding `shared_blocks` blocks, replayed by
    `kvtier.fleet.replay_fleet` (module docstring)."""
    from kvtier.fleet import replay_fleet

    config = dataclasses.replace(
        config, primary=dataclasses.replace(config.primary, eviction=policy)
    )
    result = replay_fleet(
        requests, config, engines, primary, route, seed, block_bytes, None, shared_blocks
    )
    tier = config.tiers[0]
    fleet = result.fleet
    shared = fleet.shared_hit_tokens
    hit_tokens = {PRIMARY: fleet.hit_tokens - shared, tier.name: shared}
    layer = Layer(
        tier.name, tier.type, shared_blocks, tier.write, tier.admit_after_hits, order_of(tier)
    )
    saved = fleet.hit_tokens / pricing.prefill_rate
    load = hit_tokens[PRIMARY] * pricing.token_bytes / (pricing.gbps(PRIMARY, PRIMARY) * 1e9)
    load += shared * pricing.token_bytes / (pricing.gbps(tier.name, tier.type) * 1e9)
    return PlanResult(primary, policy, (layer,), fleet.total_tokens, hit_tokens, saved, load)


def blocks_of(size_bytes: int, token_bytes: int) -> int:
    """The whole blocks of `BLOCK_TOKENS` tokens a tier of `size_bytes` holds."""
    return size_bytes // (BLOCK_TOKENS * token_bytes)
