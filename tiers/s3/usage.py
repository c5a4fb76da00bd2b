"""The S3 tier's store-wide usage, driven from the runtime's loop, the bucket's calls in the
tier's thread pool (`tiers.s3.client.Bucket`): every namespace under the tier's prefix.

The prefix is listed a page (`PAGE` names) at a time, so memory stays bounded whatever the
bucket holds:

- `<prefix><namespace hex>/<ab>/<key hex>` is one block object;
- `<prefix><namespace hex>/packs/<id>` is a pack: its bytes are the object's, its objects the
  blocks its index lists, read as the tier's own loader reads and bounds an index
  (`tiers.s3.packformat`: the first `PACK_HEAD` bytes, at most `MAX_PACK_INDEX`), once per pack and
  kept for the next listing (a pack is written once and never changes), for up to
  `MAX_COUNTED_PACKS` packs; a pack whose index kvtier would refuse counts its bytes and no
  block;
- anything else under the prefix is no kvtier name (a lease, a stranger's object): left out.

Sizes and times of writing (LastModified) come from the listing, packs included.
"""

from __future__ import annotations

import asyncio

from tiering.errors import KeyFormatError, TierError, TierTimeout, TierUnavailable
from tiering.keys import key_from_hex
from tiering.tier.usage import UsageTally, namespace_of
from tiers.s3.client import Bucket
from tiers.s3.packformat import MAX_PACK_INDEX, PACK_HEAD, pack_entries
from tiers.s3.packs import PACK_LOADS

__all__ = ["MAX_COUNTED_PACKS", "PAGE", "BucketUsage"]

PAGE = 1000
"""Names listed at a time (S3's largest page)."""
MAX_COUNTED_PACKS = 200_000
"""Packs whose block counts are kept between listings (~150 bytes each)."""


class BucketUsage:
    """One S3 tier's usage listings (runtime thread)."""

    def __init__(self, bucket: Bucket, prefix: str) -> None:
        self.bucket = bucket
        self.prefix = prefix
        self._blocks: dict[str, int] = {}
        """Pack name -> blocks its index lists."""

    async def scan(self) -> UsageTally:
        tally = UsageTally()
        seen: set[str] = set()
        token: str | None = None
        while True:
            page, token = await self.bucket.list_page_meta(self.prefix, token, PAGE)
            packs: list[tuple[bytes, str, int, float]] = []
            for name, size, modified in page:
                found = self._parse(name)
                if found is None:
                    continue
                namespace, is_pack = found
                if is_pack:
                    packs.append((namespace, name, size, modified))
                else:
                    tally.add(namespace, size, modified)
            counts = await self._count(packs)
            for (namespace, name, size, modified), blocks in zip(packs, counts, strict=True):
                if name in self._blocks:  # kept: still in the bucket
                    seen.add(name)
                tally.add(namespace, size, modified, blocks)
            if token is None:
                break
        self._blocks = {name: n for name, n in self._blocks.items() if name in seen}
        return tally

    def _parse(self, name: str) -> tuple[bytes, bool] | None:
        """(namespace, is a pack) of a name under the prefix; None for no kvtier name."""
        parts = name[len(self.prefix) :].split("/")
        if len(parts) != 3:
            return None
        namespace = namespace_of(parts[0])
        if namespace is None or not parts[2]:
            return None
        if parts[1] == "packs":
            return namespace, True
        try:
            key = key_from_hex(parts[2])
        except KeyFormatError:
            return None
        return (namespace, False) if key.hex()[:2] == parts[1] else None

    async def _count(self, packs: list[tuple[bytes, str, int, float]]) -> list[int]:
        gate = asyncio.Semaphore(PACK_LOADS)

        async def one(name: str, size: int) -> int:
            known = self._blocks.get(name)
            if known is not None:
                return known
            async with gate:
                blocks = await self._read_count(name, size)
            if blocks is not None and len(self._blocks) < MAX_COUNTED_PACKS:
                self._blocks[name] = blocks
            return blocks or 0

        return await asyncio.gather(*(one(name, size) for _, name, size, _ in packs))

    async def _read_count(self, name: str, size: int) -> int | None:
        """The blocks a pack's index lists (0: an index kvtier refuses); None when the pack
        is gone, or this read failed for this object only (not kept: read again next time)."""
        try:
            first = await self.bucket.get_range(name, 0, min(size, PACK_HEAD))
            if first is None:
                return None
            if len(first) < 4:
                return 0
            length = int.from_bytes(first[:4], "big")
            if length > MAX_PACK_INDEX or 4 + length > size:
                return 0
            head = first[4 : 4 + length]
            if len(head) < length:
                rest = await self.bucket.get_range(name, 4, length)
                if rest is None:
                    return None
                head = rest
        except (TierUnavailable, TierTimeout):
            raise
        except TierError:  # this object's read (a planted SSE-C object...), not the server's
            return None
        if len(head) != length:
            return 0
        entries = pack_entries(head, size - 4 - length)
        return 0 if entries is None else len(entries)
