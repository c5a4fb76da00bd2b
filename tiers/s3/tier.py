"""The S3 tier: blocks as objects in a bucket (AWS S3 or any S3-compatible server).

Object names: `<prefix><namespace hex>/<ab>/<key hex>` — spread over 256 prefixes by the key's
first byte, since S3 scales request rates per prefix. The calls to the bucket (boto3 in a
bounded thread pool) are `tiers.s3.client`'s; single objects are written once where the server
honours `If-None-Match: *` (`write_once`). With `blocks_per_object` > 1, puts are gathered into
packs (`tiers.s3.packs`: the tier's index of packs; `tiers.s3.packformat`: the format), written
by `tiers.s3.packer` within `pack_after`, and the index is kept live by `tiers.s3.refresh`
(other engines' packs are found within `pack_refresh`). With `capacity`, `tiers.s3.sweeper`
keeps the prefix within it, one engine at a time by `tiers.s3.lease`.

An `https://` endpoint is verified against `ca_bundle` (null: the system's CAs), tried at open
(`tiers.tls`): a wrong CA, an expired certificate or a plaintext server is a one-line
`TlsError` there, never a fall back to plaintext.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from tiering.errors import CorruptObject, TierFull
from tiering.keys import BlockKey
from tiering.tier import Buffer, NamespaceUsage, ObjectInfo, Tier, TierStat
from tiering.tier.envelope import Envelope
from tiering.tier.options import TierOptions, option
from tiering.tier.records import RECORD_PAGE
from tiers.s3.client import Bucket
from tiers.s3.lease import Lease
from tiers.s3.packer import Packer
from tiers.s3.packformat import MAX_PACK_ENTRIES
from tiers.s3.packs import Packs
from tiers.s3.reads import ReadLog, reads_name
from tiers.s3.refresh import Refresher
from tiers.s3.sweeper import Sweeper
from tiers.s3.usage import BucketUsage
from tiers.s3.use import Named, UseOrder
from tiers.tls import check_handshake, client_context

__all__ = ["S3Options", "S3Tier"]


def _unshown(field: Any) -> Any:
    """`field` (an `option`) left out of the record's repr: a secret must not reach a log."""
    field.repr = False
    return field


@dataclass(frozen=True, kw_only=True, slots=True)
class S3Options(TierOptions):
    """The S3 tier's settings (any thread: a value)."""

    bucket: str = option(low=1, what="a bucket name", help="The bucket blocks are stored in.")
    prefix: str = option("", help="Prepended to every object name (a folder of the bucket).")
    endpoint_url: str | None = option(
        None, help="An S3-compatible server's URL (null: AWS S3 of `region`)."
    )
    ca_bundle: str | None = option(
        None,
        help="CA bundle that verifies an `https://` endpoint's certificate (null: the system's "
        "CAs). TLS is tried at open: a wrong CA, an expired certificate or a plaintext server "
        "is an error there, never a fall back to plaintext.",
    )
    region: str | None = option(None, help="The bucket's region (null: us-east-1).")
    access_key: str | None = option(
        None, help="Access key id (null: the standard chain: environment, profile, role)."
    )
    secret_key: str | None = _unshown(option(None, help="Secret access key; use `${ENV_VAR}`."))
    session_token: str | None = _unshown(
        option(None, help="Session token of temporary credentials.")
    )
    blocks_per_object: int = option(
        1,
        low=1,
        high=MAX_PACK_ENTRIES,
        help="Blocks gathered into one object (a pack) before it is written; 1: no packs.",
    )
    pack_after: float = option(
        2.0,
        kind="duration",
        low=0.01,
        help="The longest a block waits in memory for its pack: a partial pack is written then "
        "(what a crash can lose).",
    )
    pack_refresh: float = option(
        1.0,
        kind="duration",
        low=0.05,
        help="How often the index of packs lists the packs other engines wrote since (the "
        "longest they stay unseen).",
    )
    write_once: bool = option(
        True,
        help="Write a block only where the bucket has none (If-None-Match: *, packs the index "
        "knows): engines sharing the bucket write each block once.",
    )
    sweep_interval: float = option(
        10.0,
        kind="duration",
        low=0.1,
        help="With `capacity`: how often the prefix's one sweeper (elected by a lease object) "
        "deletes objects beyond capacity: first those no live engine's manifest of use names "
        "(engines with `primary.warm_start` write one), least recently used first (written, or "
        "read as the engines' records of reads say: `reads_interval`), then the least hot "
        "named; oldest written first when engines write neither (`kvtier stats` says which "
        "order).",
    )
    reads_interval: float = option(
        30.0,
        kind="duration",
        zero=True,
        help="With `capacity`: how often this engine writes the keys it read from the prefix "
        "(its record of reads, the newest 65,536 of the last three intervals), so that the "
        "sweeper removes the least recently used first, as far as engines tell it (0: never; "
        "the sweeper then knows only writes and the manifests of use).",
    )
    multipart_threshold: int = option(
        64 << 20, kind="size", help="Objects larger than this go up in parts."
    )
    part_size: int = option(16 << 20, kind="size", help="Size of each part (at least 5 MiB).")
    retries: int = option(3, high=100, help="Attempts of each request (botocore's standard mode).")
    connect_timeout: float = option(2.0, kind="duration", help="Timeout of each connection.")
    read_timeout: float = option(10.0, kind="duration", help="Timeout of each response.")


class S3Tier(Tier):
    """Blocks in an S3 bucket, on the runtime's event loop thread; boto3 calls in a pool of
    `concurrency` threads (`tiers.s3.client`)."""

    type_name = "s3"
    persistent = True
    shared = True
    supports_listing = True
    Options = S3Options
    options: S3Options

    def __init__(
        self,
        *,
        namespace: bytes,
        secret: bytes | None = None,
        name: str | None = None,
        **options: Any,
    ) -> None:
        """Credentials come from the standard chain (environment, profile, instance role)
        unless given; `endpoint_url` points at an S3-compatible server."""
        super().__init__(namespace=namespace, secret=secret, name=name, **options)
        settings = self.options  # the record refuses an empty bucket, a pack size out of range
        self.bucket = settings.bucket
        self.prefix = settings.prefix
        self.blocks_per_object = settings.blocks_per_object
        self.multipart_threshold = settings.multipart_threshold
        self.part_size = max(settings.part_size, 5 << 20)
        self.endpoint_url = settings.endpoint_url
        self._base = f"{self.prefix}{self.namespace.hex()}/"
        self._check_tls(settings.connect_timeout)
        self._bucket = Bucket(
            tier=self.name,
            bucket=self.bucket,
            endpoint_url=self.endpoint_url,
            ca_bundle=settings.ca_bundle,
            region=settings.region,
            access_key=settings.access_key,
            secret_key=settings.secret_key,
            session_token=settings.session_token,
            multipart_threshold=self.multipart_threshold,
            part_size=self.part_size,
            retries=settings.retries,
            connect_timeout=settings.connect_timeout,
            read_timeout=settings.read_timeout,
            concurrency=self.concurrency,
        )
        self.writes_once = settings.write_once
        self._packs = Packs(
            self._bucket,
            self._base,
            self.name,
            self.counters,
            self.blocks_per_object,
            self.writer,
        )
        self._refresher = Refresher(
            self._bucket,
            self._packs,
            tier=self.name,
            counters=self.counters,
            period=settings.pack_refresh,
            enabled=self.blocks_per_object > 1,
        )
        writes = max(1, self.concurrency // 2)
        self._packer = Packer(
            self._packs,
            self._bucket,
            tier=self.name,
            counters=self.counters,
            after=settings.pack_after,
            writes=writes,
            limit=(writes + 2) * self.blocks_per_object,
            ready=self._clock,
        )
        self._usage_scan = BucketUsage(self._bucket, self.prefix)
        self._use = UseOrder(
            self._bucket,
            self.prefix,
            tier=self.name,
            envelope=lambda ns: (
                self.envelope if ns == self.namespace else Envelope.of(ns, secret=secret)
            ),
            room=self.header_room,
            counters=self.counters,
            pack_of=self._pack_of,
        )
        self._sweeper = None
        self._reads: ReadLog | None = None
        if self.capacity is not None and not self.read_only:
            self._reads = ReadLog(
                tier=self.name,
                namespace=self.namespace,
                name=reads_name(self.writer),
                interval=settings.reads_interval,
                write=self.write_record,
                counters=self.counters,
                clock=self._bucket.server_time,
            )
            self._sweeper = Sweeper(
                self._bucket,
                self.prefix,
                tier=self.name,
                capacity=self.capacity,
                interval=settings.sweep_interval,
                lease=Lease(
                    self._bucket,
                    self.prefix,
                    tier=self.name,
                    writer=self.writer,
                    counters=self.counters,
                    mac=self.envelope.mac,
                ),
                counters=self.counters,
                swept=self._packs.drop,
                use=self._use,
            )

    def _pack_of(self, namespace: bytes, key: BlockKey) -> str | None:
        """The pack this tier's index knows block `key` of `namespace` to lie in (its own
        namespace only)."""
        if namespace != self.namespace:
            return None
        packed = self._packs.where(key)[1]
        return None if packed is None else packed[0]

    def _check_tls(self, timeout: float) -> None:
        """The TLS of an `https://` endpoint, tried once at open (`tiers.tls`): a CA bundle
        that cannot be read is a `ConfigError`; a wrong CA, an expired certificate or a
        plaintext server a `TlsError`. AWS's own endpoints (no `endpoint_url`) are left to
        botocore."""
        url = self.endpoint_url
        if url is None or not url.lower().startswith("https://"):
            return
        parsed = urlsplit(url)
        context = client_context(self.name, self.options.ca_bundle, ca_option="ca_bundle")
        host, port = parsed.hostname or "", parsed.port or 443
        hello = f"HEAD / HTTP/1.1\r\nHost: {parsed.netloc}\r\nConnection: close\r\n\r\n"
        check_handshake(self.name, host, port, context, timeout, hello=hello.encode())

    async def _clock(self) -> None:
        """Learn the server's clock (which names packs): one listing of one name."""
        await self._bucket.list_page(self._packs.prefix, None, 1)

    def _name(self, key: BlockKey) -> str:
        text = key.hex()
        return f"{self._base}{text[:2]}/{text}"

    def _record_name(self, name: str) -> str:
        """A record's object (`tiering.tier.records`): beside the namespaces' folders under
        the prefix, like the lease (never a namespace's object, packed, listed or swept)."""
        return f"{self.prefix}kvtier-records/{self.namespace.hex()}.{name}"

    async def _read_record(self, name: str, limit: int) -> Buffer | None:
        return await self._bucket.get(self._record_name(name), limit)

    async def _write_record(self, name: str, blob: bytes) -> bool:
        await self._bucket.put(self._record_name(name), blob)
        return True

    async def _delete_record(self, name: str) -> bool:
        """S3's DELETE answers alike whether the object was there: one HEAD first says."""
        found = await self._bucket.head(self._record_name(name))
        if found:
            await self._bucket.delete(self._record_name(name))
        return found

    async def _list_records(self, prefix: str, limit: int) -> list[str]:
        """ListObjectsV2 of the records' prefix, `RECORD_PAGE` names a page, up to `limit`."""
        base = self._record_name("")
        found: list[str] = []
        token: str | None = None
        while len(found) < limit:
            page, token = await self._bucket.list_page(
                base + prefix, token, min(RECORD_PAGE, limit - len(found))
            )
            found += [name[len(base) :] for name, _, _ in page]
            if token is None:
                break
        return found

    # -- primitives -----------------------------------------------------------------------------

    async def _read(self, key: BlockKey, limit: int) -> Buffer | None:
        await self._refresher.load()
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
            self._packs.drop({pack})  # gone from the bucket (swept), or its range is not there
        return await self._bucket.get(self._name(key), limit)

    async def _read_head(self, key: BlockKey, n: int) -> tuple[Buffer, int] | None:
        await self._refresher.load()
        pending, packed = self._packs.where(key)
        if pending is not None:
            return pending[:n], len(pending)
        if packed is not None:
            pack, offset, length = packed
            head = await self._bucket.get_range(pack, offset, min(n, length))
            if head is not None:
                return head, length
            self._packs.drop({pack})
        return await self._bucket.get_head(self._name(key), n)

    async def _write(self, key: BlockKey, parts: Sequence[Buffer]) -> bool | None:
        if self._sweeper is not None:
            if self._sweeper.refusal is not None:  # writes only: promotions go on
                raise TierFull(self._sweeper.refusal)
            self._sweeper.start()
        if self.blocks_per_object == 1:
            written = await self._bucket.put(
                self._name(key), b"".join(parts), once=self.writes_once
            )
            if not written:
                self._served(key)  # there already: the fleet wants it again
            return written
        if self.writes_once and self._packs.known([key])[0]:
            self._served(key)
            return False  # packed already (by any engine the index has listed), or held
        # No wait for the packs to load: a block packed before the load ends keeps its new
        # place (the load never overrides a key it finds packed), and puts are not held up.
        await self._packer.hold(key, b"".join(parts))
        return None

    async def _delete(self, key: BlockKey) -> bool:
        await self._refresher.load()
        forgotten, empty_pack = self._packs.forget(key)
        if empty_pack is not None:
            await self._bucket.delete(empty_pack)
        existed = await self._bucket.head(self._name(key))
        if existed:
            await self._bucket.delete(self._name(key))
        return existed or forgotten

    async def _delete_refused(self, key: BlockKey, seen: bytes | None) -> bool:
        """Only the copy `_read` read: the packed one where the index has one (a pack that
        lies about a key proves nothing of its single object, another engine's: the index
        forgets the key, so a put writes it again), else the single object, while it is the
        one read (its head compared, then deleted `If-Match` the version compared)."""
        pending, packed = self._packs.where(key)
        if pending is None and packed is None:
            if seen is None:
                return await self._delete(key)
            name = self._name(key)
            version = await self._bucket.head_meta(name)
            head = None if version is None else await self._bucket.get_head(name, len(seen))
            if version is None or head is None or bytes(head[0]) != seen:
                return False
            return await self._bucket.delete_if_match(name, version[0])
        forgotten, empty_pack = self._packs.forget(key)
        if empty_pack is not None:
            await self._bucket.delete(empty_pack)
        return forgotten

    async def _contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        await self._refresher.load()
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
        await self._refresher.load()
        seen = self._packs.keys()
        for key in seen:
            yield key
        for name, _ in await self._bucket.list_objects(self._base):
            found = self._key_of(name)
            if found is not None and found not in seen:
                yield found

    async def _entries(self) -> AsyncIterator[ObjectInfo]:
        await self._refresher.load()
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
        await self._refresher.load()
        objects = await self._bucket.list_objects(self._base)
        singles = [(n, size) for n, size in objects if "/packs/" not in n]
        pending, packed = self._packs.sizes()
        return TierStat(
            len(packed) + len(pending) + len(singles),
            sum(packed.values()) + sum(pending.values()) + sum(s for _, s in singles),
            self.capacity,
        )

    async def _usage(self) -> list[NamespaceUsage]:
        """Every namespace under `prefix` in the bucket, whoever wrote it (`tiers.s3.usage`;
        blocks still waiting for a pack in this process are not in the bucket yet)."""
        tally = await self._usage_scan.scan()
        return tally.result(self.name)

    def _served(self, key: BlockKey) -> None:
        if self._reads is not None:
            self._reads.note(key)

    async def _close(self) -> None:
        try:
            if self._reads is not None:
                await self._reads.close()
            await self._refresher.stop()
            await self._packer.close()
            if self._sweeper is not None:
                await self._sweeper.stop()
        finally:
            self._bucket.shutdown()

    # -- beyond the contract -------------------------------------------------------------------

    async def sweep_order(self) -> Named | None:
        """The order the prefix's sweeper removes objects in now, read from the live manifests
        as the sweeper reads them (`tiers.s3.use`); None without `capacity` (no sweeper)."""
        if self.capacity is None:
            return None
        return await self._use.named()

    async def refresh_packs(self) -> None:
        """List every pack in the bucket now (`tiers.s3.refresh.Refresher.full`): what the
        background refreshes do within `pack_refresh`, for a caller that cannot wait."""
        await self._refresher.full()
