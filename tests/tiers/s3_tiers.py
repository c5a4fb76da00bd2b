"""An S3 tier on the test session's SeaweedFS server, under a prefix of the test's own (the S3
test modules' one way of making one)."""

from __future__ import annotations

from typing import Any

from kvtier.servers import SeaweedS3
from tiering.testing import NAMESPACE
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
