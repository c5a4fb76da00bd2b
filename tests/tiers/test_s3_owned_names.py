"""A pack forged in an owner's own names (real SeaweedFS): whoever lists the bucket sees the
owner's store namespace and can write a pack there claiming the owner's keys. The owner
refuses each claimed block once, forgets it and packs its own copy: no key is unusable for
good, for the engine that read the forgery or for one that starts after it."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest

from kvtier.servers import SeaweedS3
from tests.tiers.s3_tiers import s3_tier
from tiering.keys import store_namespace
from tiering.testing import NAMESPACE, SECRET, craft, key, payload

pytestmark = pytest.mark.s3

OWN = store_namespace(NAMESPACE, SECRET)
SIZE = 3000


def test_a_pack_forged_in_the_owners_names_costs_each_engine_one_miss(
    s3_server: SeaweedS3,
) -> None:
    prefix = f"owned-{uuid.uuid4().hex[:8]}/"
    keys = [key(i) for i in range(4)]
    forged = [craft(k, payload(SIZE, 90), namespace=OWN) for k in keys]  # no MAC
    offsets = [sum(len(f) for f in forged[:i]) for i in range(len(forged))]
    index = {k.hex(): [o, len(f)] for k, o, f in zip(keys, offsets, forged, strict=True)}
    head = json.dumps(index).encode()
    client: Any = s3_server.client()
    client.put_object(
        Bucket=s3_server.bucket,
        Key=f"{prefix}{OWN.hex()}/packs/t000000000000-forged",  # sorts before any engine's
        Body=len(head).to_bytes(4, "big") + head + b"".join(forged),
    )

    def owner() -> Any:
        return s3_tier(s3_server, prefix, namespace=OWN, secret=SECRET, blocks_per_object=4)

    async def cache_and_hit(tier: Any) -> int:
        """Each key read, put where it missed, and read again: a hit with the owner's bytes.
        How many were refused misses."""
        for i, k in enumerate(keys):
            got = await tier.get_bytes(k, SIZE)
            if got is None:
                await tier.put(k, payload(SIZE, i))
                got = await tier.get_bytes(k, SIZE)
            assert got == payload(SIZE, i), i
        assert tier.counters["duplicates"] == 0, dict(tier.counters)
        assert tier.counters["corrupt.auth"] <= len(keys)
        return int(tier.counters["corrupt.auth"])

    async def body() -> None:
        async with owner() as first:
            assert await cache_and_hit(first) == len(keys)  # the forged pack was all it had
        async with owner() as later:  # both packs listed: whichever it loaded first
            await cache_and_hit(later)
        async with owner() as reader:  # never the forged bytes, whichever pack it loaded
            found = [await reader.get_bytes(k, SIZE) for k in keys]
            assert all(f is None or f == payload(SIZE, i) for i, f in enumerate(found))

    asyncio.run(body())
