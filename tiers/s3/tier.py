"""The S3 tier: blocks as objects in a bucket (AWS S3 or any S3-compatible server).

Object names: `<prefix><namespace hex>/<ab>/<key hex>` — spread over 256 prefixes by the key's
first byte, since S3 scales request rates per prefix. The calls to the bucket (boto3 in a
bounded thread pool) are `tiers.s3.client`'s. With `blocks_per_object` > 1, puts are gathered
and written `blocks_per_object` at a time as one pack (`tiers.s3.packs`: the pack format and the
tier's index of packs, rebuilt from the bucket at start).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from tiering.config import parse_size
from tiering.errors import ConfigError, CorruptObject
from tiering.keys import BlockKey
from tiering.tier import Buffer, ObjectInfo, Tier, TierStat
from tiers.s3.client import Bucket
from tiers.s3.packs import MAX_PACK_ENTRIES, Packs

__all__ = ["S3Tier"]


class S3Tier(Tier):
    """Blocks in an S3 bucket. Runs on the runtime's event loop; boto3 calls in a pool of
    `concurrency` threads."""

    type_name = "s3"
    persistent = True
    shared = True
    supports_listing = True

    def __init__(
        self,
        *,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        session_token: str | None = None,
        blocks_per_object: int = 1,
        multipart_threshold: int | str = "64MiB",
        part_size: int | str = "16MiB",
        retries: int = 3,
        connect_timeout: float = 2.0,
        read_timeout: float = 10.0,
        **options: Any,
    ) -> None:
        """Credentials come from the standard chain (environment, profile, instance role)
        unless given; `endpoint_url` points at an S3-compatible server."""
        super().__init__(**options)
        if not bucket:
            raise ConfigError(f"tier {self.name!r}: bucket must not be empty")
        if not 1 <= blocks_per_object <= MAX_PACK_ENTRIES:
            raise ConfigError(
                f"tier {self.name!r}: blocks_per_object must be 1-{MAX_PACK_ENTRIES},"
                f" got {blocks_per_object}"
            )
        self.bucket = bucket
        self.prefix = prefix
        self.blocks_per_object = blocks_per_object
        self.multipart_threshold = parse_size(multipart_threshold, "multipart_threshold")
        self.part_size = max(parse_size(part_size, "part_size"), 5 << 20)
        self.endpoint_url = endpoint_url
        self._base = f"{prefix}{self.namespace.hex()}/"
        self._bucket = Bucket(
            tier=self.name,
            bucket=bucket,
            endpoint_url=endpoint_url,
            region=region,
            access_key=access_key,
            secret_key=secret_key,
            session_token=session_token,
            multipart_threshold=self.multipart_threshold,
            part_size=self.part_size,
            retries=retries,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            concurrency=self.concurrency,
        )
        self._packs = Packs(self._bucket, self._base, self.name, self.counters, blocks_per_object)

    def _name(self, key: BlockKey) -> str:
        text = key.hex()
        return f"{self._base}{text[:2]}/{text}"

    # -- primitives -----------------------------------------------------------------------------

    async def _read(self, key: BlockKey, limit: int) -> Buffer | None:
        await self._packs.load()
        pending, packed = self._packs.where(key)
        if pending is not None:
            return pending
        if packed is not None:
            pack, offset, length = packed
            if length > limit:
                raise CorruptObject(
                    "length", f"pack {pack} gives it {length} bytes, at most {limit}"
                )
            blob = await self._bucket.get_range(pack, offset, length)
            if blob is not None:
                return blob
        return await self._bucket.get(self._name(key), limit)

    async def _read_head(self, key: BlockKey, n: int) -> tuple[Buffer, int] | None:
        await self._packs.load()
        pending, packed = self._packs.where(key)
        if pending is not None:
            return pending[:n], len(pending)
        if packed is not None:
            pack, offset, length = packed
            head = await self._bucket.get_range(pack, offset, min(n, length))
            if head is not None:
                return head, length
        return await self._bucket.get_head(self._name(key), n)

    async def _write(self, key: BlockKey, parts: Sequence[Buffer]) -> None:
        blob = b"".join(parts)
        if self.blocks_per_object == 1:
            await self._bucket.put(self._name(key), blob)
            return
        # No wait for the packs to load: a block packed before the load ends keeps its new
        # place (the load never overrides a key it finds packed), and puts are not held up.
        batch = self._packs.hold(key, blob)
        if batch is not None:
            await self._packs.write(batch)

    async def _delete(self, key: BlockKey) -> bool:
        await self._packs.load()
        forgotten, empty_pack = self._packs.forget(key)
        if empty_pack is not None:
            await self._bucket.delete(empty_pack)
        existed = await self._bucket.head(self._name(key))
        if existed:
            await self._bucket.delete(self._name(key))
        return existed or forgotten

    async def _contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        await self._packs.load()
        known = self._packs.known(list(keys))
        heads = await asyncio.gather(
            *(
                self._bucket.head(self._name(k))
                for k, found in zip(keys, known, strict=True)
                if not found
            )
        )
        answers = iter(heads)
        return [found or next(answers) for found in known]

    async def _list(self) -> AsyncIterator[BlockKey]:
        await self._packs.load()
        seen = self._packs.keys()
        for key in seen:
            yield key
        for name, _ in await self._bucket.list_objects(self._base):
            found = self._key_of(name)
            if found is not None and found not in seen:
                yield found

    async def _entries(self) -> AsyncIterator[ObjectInfo]:
        await self._packs.load()
        pending, packed = self._packs.sizes()
        for key, size in pending.items():
            yield ObjectInfo(key, size)
        for key, length in packed.items():
            if key not in pending:
                yield ObjectInfo(key, length)
        for name, size, modified in await self._bucket.list_objects_meta(self._base):
            found = self._key_of(name)
            if found is not None and found not in pending and found not in packed:
                yield ObjectInfo(found, size, modified)

    def _key_of(self, name: str) -> BlockKey | None:
        """The key an object's name gives, None for packs and for names no kvtier wrote
        (skipped and counted: anyone with write access may put anything in a bucket)."""
        if "/packs/" in name:
            return None
        return self.listed_key(name.rsplit("/", 1)[-1])

    async def _namespaces(self) -> list[bytes]:
        found = set()
        for name, _ in await self._bucket.list_objects(self.prefix):
            part = name[len(self.prefix) :].split("/", 1)[0]
            if len(part) == 32:
                try:
                    found.add(bytes.fromhex(part))
                except ValueError:
                    continue
        return sorted(found)

    async def _stat(self) -> TierStat:
        await self._packs.load()
        objects = await self._bucket.list_objects(self._base)
        singles = [(n, size) for n, size in objects if "/packs/" not in n]
        pending, packed = self._packs.sizes()
        return TierStat(
            len(packed) + len(pending) + len(singles),
            sum(packed.values()) + sum(pending.values()) + sum(s for _, s in singles),
            self.capacity,
        )

    async def _close(self) -> None:
        await self._packs.stop_loading()
        try:
            batch = self._packs.take_pending()
            if batch:
                await self._packs.write(batch)
        finally:
            self._bucket.shutdown()

    # -- beyond the contract -------------------------------------------------------------------

    async def refresh_packs(self) -> None:
        """Load the packs other processes wrote since this tier loaded the bucket's packs
        (`tiers.s3.packs.Packs.refresh`): a reader sharing the bucket with writers calls it to
        see their new blocks."""
        await self._packs.refresh()
