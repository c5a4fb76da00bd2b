"""An S3 tier on the test session's SeaweedFS server, under a prefix of the test's own (the S3
test modules' one way of making one)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from kvtier.servers import SeaweedS3
from tiering.testing import NAMESPACE, key, payload
from tiers.s3 import S3Tier


def s3_tier(server: SeaweedS3, prefix: str, **options: Any) -> S3Tier:
    return S3Tier(
        bucket=server.bucket,
        prefix=prefix,
        endpoint_url=server.endpoint,
        access_key=server.ACCESS_KEY,
        secret_key=server.SECRET_KEY,
        **{"namespace": NAMESPACE, **options},
    )


def s3_tier_entry(server: SeaweedS3, prefix: str, **options: Any) -> dict[str, Any]:
    """A config's entry of the same tier (named `objects`), for `kvtier` commands."""
    return {
        "name": "objects",
        "type": "s3",
        "bucket": server.bucket,
        "prefix": prefix,
        "endpoint_url": server.endpoint,
        "access_key": server.ACCESS_KEY,
        "secret_key": server.SECRET_KEY,
        **options,
    }


SIZE = 4000
"""The bytes of the blocks `fill_ten` writes."""
SECRET = b"s3-use-test-secret-0123456789abcdef"
"""A deployment secret for tiers that seal."""


def use_prefix() -> str:
    return f"use-{uuid.uuid4().hex[:8]}/"


async def fill_ten(server: SeaweedS3, prefix: str, **options: Any) -> int:
    """Blocks 0-4, then a second later (LastModified has a second's precision) blocks 5-9:
    0-4 are the oldest written. The size of one object."""
    async with s3_tier(server, prefix, **options) as writer:
        for i in range(5):
            await writer.put(key(i), payload(SIZE, i))
        await asyncio.sleep(1.1)
        for i in range(5, 10):
            await writer.put(key(i), payload(SIZE, i))
        sizes = {size for _, size, _ in await writer._bucket.list_objects_meta(prefix)}
    (size,) = sizes
    return size


async def sweep_to_capacity(tier: S3Tier) -> None:
    """Sweep passes until one leaves nothing over capacity (bounded)."""
    assert tier._sweeper is not None
    for _ in range(4):
        if not await tier._sweeper.sweep():
            return
    raise AssertionError(f"still over capacity: {tier.counters}")


async def present_of_ten(tier: S3Tier) -> list[int]:
    found = await tier.contains([key(i) for i in range(10)])
    return [i for i in range(10) if found[i]]
