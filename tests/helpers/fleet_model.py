"""An independent replay of a fleet over one shared tier, by block ids, for checking what
`kvtier replay --engines N` reports (issue 44). It shares no code with `kvtier/` on purpose: it
reads the trace's JSONL itself and routes with its own seeded RNG (the same draws as
`kvtier.fleet.routing`'s `random`: `random.Random(seed).randrange(engines)` per request).

The model: requests in file order, each on its engine. Its blocks are looked up front to back
and count as hit while found, in the engine's primary (an LRU of `primary` blocks) or else in
the shared tier (of `shared` blocks), a tier hit being copied into the primary; the first
block found in neither ends the hits. The hit blocks are used in order; then every block
after the hits that the primary lacks is stored there and written through to the shared tier.
The primary never evicts a block of the request being served. The shared tier evicts least
recently used first (`by_use`: a read or a write uses a block) or by write order (a read does
not; with `rewrite` false a write of a block it holds does not either: a write-once medium, S3
with `write_once`, keeps the first write's object and its LastModified). The hit rate is hit
tokens over all tokens of the second half of the requests (512 tokens a block, the last block
the rest of `input_length`).
"""

from __future__ import annotations

import gzip
import json
import random
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

__all__ = ["model_hit_rate", "read_requests"]

Request = tuple[tuple[int, ...], int]
"""A request's block ids and its input length."""


def read_requests(path: Path, limit: int | None = None) -> list[Request]:
    """The first `limit` requests (all: None) of a Mooncake JSONL trace (gzipped: `.gz`)."""
    out: list[Request] = []
    with gzip.open(path, "rt") if path.suffix == ".gz" else path.open() as lines:
        for line in lines:
            if not line.strip():
                continue
            row = json.loads(line)
            out.append((tuple(row["hash_ids"]), int(row["input_length"])))
            if limit is not None and len(out) == limit:
                break
    return out


def model_hit_rate(
    requests: Sequence[Request],
    engines: int,
    primary: int,
    shared: int,
    *,
    by_use: bool = True,
    rewrite: bool = True,
    seed: int = 0,
) -> float:
    """The fleet's hit rate (a fraction) under the module's model, routed at random.
    `rewrite` false: a write of a block the shared tier holds leaves it where it was (a
    write-once medium: S3 with `write_once` keeps the first write's object and LastModified)."""
    rng = random.Random(seed)
    primaries: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(engines)]
    tier: OrderedDict[int, None] = OrderedDict()
    measured_from = len(requests) // 2
    hit_tokens = total_tokens = 0
    for index, (ids, length) in enumerate(requests):
        pool = primaries[rng.randrange(engines)]
        hits = 0
        for block in ids:
            if block in pool:
                pool.move_to_end(block)
            elif block in tier:
                if by_use:
                    tier.move_to_end(block)
                _insert(pool, block, primary, ids)
            else:
                break
            hits += 1
        for block in ids[hits:]:
            if not _insert(pool, block, primary, ids):
                continue
            if block in tier and not rewrite:
                continue
            tier.pop(block, None)
            tier[block] = None
            while len(tier) > shared:
                tier.popitem(last=False)
        if index >= measured_from:
            tokens = [max(1, min(512, length - 512 * i)) for i in range(len(ids))]
            hit_tokens += sum(tokens[:hits])
            total_tokens += sum(tokens)
    return hit_tokens / total_tokens if total_tokens else 0.0


def _insert(
    pool: OrderedDict[int, None], block: int, capacity: int, request: Sequence[int]
) -> bool:
    """Whether `block` is new to an LRU primary, which holds it now as its most recent (unless
    the request's own blocks fill it), evicting its least recent blocks not of `request`."""
    if block in pool:
        pool.move_to_end(block)
        return False
    if len(pool) >= capacity:
        keep = set(request)
        victims = []
        for old in pool:
            if old not in keep:
                victims.append(old)
                if len(pool) - len(victims) < capacity:
                    break
        for old in victims:
            del pool[old]
    if len(pool) < capacity:
        pool[block] = None
    return True
