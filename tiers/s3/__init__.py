"""The S3 tier (`S3Tier`): blocks as objects in a bucket, alone or gathered in packs.

`tier` holds the tier, `packs` the pack format and the index of packs, `client` the calls to
the bucket (boto3 in a thread pool).
"""

from tiers.s3.tier import S3Options, S3Tier

__all__ = ["S3Options", "S3Tier"]
