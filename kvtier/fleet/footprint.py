"""The replay's thread: what one synthesized block takes in a fleet's shared tier, so that its
capacity can be given, and reported, in blocks.

A replay's blocks are small (64 bytes unless `--block-bytes` says), a real KV block is not: a
capacity in bytes sized for real blocks holds a different number of synthetic ones, and on a
medium that charges more than an object's length the difference is large (a `files` directory
with O_DIRECT charges a 64-byte block 8 KiB: a 4 KiB header, then the payload, rounded up). The
hit rate depends on how many blocks the tier holds, not on their bytes, so a replay asked for a
capacity of N blocks (`--shared-blocks`) gives the tier N times what one synthetic block takes
there (`object_footprint`), and reports the capacity both ways.

`object_footprint` writes one block to a scratch instance of the medium: the memory tier, or a
`files` directory in a temporary directory with the config's options (what the directory's count
charges: the file's size). A remote store (Redis, S3) is not written for it: its figure is the
object's length (the memory tier's), which the store's own per-key overhead adds to (Redis); an
S3 sweeper counts exactly that length per single object (`blocks_per_object` 1: a pack is
counted and removed whole).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import tempfile
from pathlib import Path

from kvtier.replay import REPLAY_NAMESPACE
from tiering.config import Config, tier_from_config
from tiering.keys import make_key
from tiers.memory import MemoryTier

__all__ = ["object_footprint", "with_capacity"]


def object_footprint(config: Config, block_bytes: int) -> int:
    """Bytes one synthesized block of `block_bytes` takes in the shared tier of `config` (the
    module docstring says how)."""
    return asyncio.run(_one(config, block_bytes))


async def _one(config: Config, block_bytes: int) -> int:
    key = make_key(hashlib.sha256(b"footprint").digest())
    entry = config.tiers[0]
    if entry.type == "file":
        with tempfile.TemporaryDirectory(prefix="kvtier-footprint-") as scratch:
            tier = tier_from_config(entry, REPLAY_NAMESPACE, config, path=scratch, capacity=None)
            async with tier:
                await tier.put(key, bytes(block_bytes))
            return sum(p.stat().st_size for p in Path(scratch).rglob("*.kv"))
    async with MemoryTier(namespace=REPLAY_NAMESPACE, secret=config.auth.secret) as memory:
        await memory.put(key, bytes(block_bytes))
        return (await memory.stat()).bytes_used


def with_capacity(config: Config, capacity: int) -> Config:
    """`config` with its shared tier's capacity `capacity` bytes."""
    entry = config.tiers[0]
    record = entry.record
    if record is not None:
        record = dataclasses.replace(record, capacity=capacity)
    tier = dataclasses.replace(entry, capacity=capacity, record=record)
    return dataclasses.replace(config, tiers=(tier, *config.tiers[1:]))
