"""The S3 tier: blocks as objects in a bucket (AWS S3 or any S3-compatible server).

Object names: `<prefix><namespace hex>/<ab>/<key hex>` — spread over 256 prefixes by the key's
first byte, since S3 scales request rates per prefix. One boto3 client (thread-safe) serves a
bounded thread pool; retries use botocore's standard mode. Objects above
`multipart_threshold` go up in parts.

With `blocks_per_object` > 1, puts are gathered and written `blocks_per_object` at a time as one
*pack* (`<prefix><namespace hex>/packs/<id>`): a 4-byte index length, a JSON index of
`key hex -> [offset, length]`, then the objects back to back. A hit reads only its byte range
(ranged GET). The tier's index of packs is rebuilt from the packs' own indexes, so packs
survive restarts: the first call starts one background load of every pack's index, which no
caller's deadline cancels (a call waits for it under its own deadline; a failed load is started
again by the next call), and `refresh_packs` reads the packs written since. Blocks not yet packed
are held in memory and written out at `close`. Deleting a packed block forgets it in this
process; the pack object itself goes when all its blocks are deleted.

Anyone who can write to the bucket can plant a pack, so what a pack's index costs is bounded:
`MAX_PACK_INDEX` bytes, `MAX_PACK_ENTRIES` entries, and `MAX_PACKED` blocks and packs indexed
from the bucket in all. A pack beyond a bound, or whose index is not what kvtier writes, is
ignored and counted (`packs_refused`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, TypeVar

import boto3
from botocore.config import Config as BotoConfig
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    ReadTimeoutError,
)

from tiering.errors import ConfigError, KeyFormatError, TierError, TierTimeout, TierUnavailable
from tiering.format import Corrupt
from tiering.keys import BlockKey, key_from_hex
from tiering.tier import Buffer, ObjectInfo, Tier, TierStat
from tiering.units import parse_size
from tiers.threads import IOThreads

__all__ = ["S3Tier"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_MISSING = ("404", "NoSuchKey", "NotFound")
MAX_PACK_ENTRIES = 4096
"""Entries a pack's index may hold: the most `blocks_per_object` allows."""
MAX_PACK_INDEX = 1 << 20
"""Bytes a pack's index may claim: an entry kvtier writes takes at most ~170 bytes (a key of
68 bytes in hex, two offsets), so `MAX_PACK_ENTRIES` of them fit. A larger claim is refused
unread."""
MAX_PACKED = 2_000_000
"""Blocks and packs the tier indexes from the bucket's packs, in all (one entry costs ~300 bytes
of memory): the packs beyond are refused. Packs this process writes count towards it but are
never refused."""
PACK_HEAD = 16 << 10
"""Bytes read from the start of a pack to find its index: one GET for any pack of up to ~100
blocks, a second for a larger index."""
PACK_LOADS = 8
"""Pack indexes read at once (through the tier's thread pool) while loading."""
PACK_PAGE = 1000
"""Pack names listed at a time while loading (S3's largest page): the listing of a bucket full
of planted packs is never held whole."""


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
        self._client = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=region or "us-east-1",
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            aws_session_token=session_token,
            config=BotoConfig(
                retries={"mode": "standard", "max_attempts": retries},
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                max_pool_connections=self.concurrency,
            ),
        )
        self._pool = IOThreads(self.concurrency, f"kvtier-{self.name}")
        # Packing: key -> (pack name, offset, length); blocks waiting for a pack; live blocks
        # per pack. Touched from pool threads, hence the lock.
        self._lock = threading.Lock()
        self._packed: dict[BlockKey, tuple[str, int, int]] = {}
        self._pending: dict[BlockKey, bytes] = {}
        self._pack_members: dict[str, set[BlockKey]] = {}
        self._packs_loaded = blocks_per_object == 1
        self._loading: asyncio.Task[None] | None = None
        self._bound_logged = False

    # -- naming and errors ---------------------------------------------------------------------

    def _name(self, key: BlockKey) -> str:
        text = key.hex()
        return f"{self._base}{text[:2]}/{text}"

    async def _run(self, function: Callable[..., T], *args: Any) -> T:
        return await self._pool.run(self._guard, function, args)

    def _guard(self, function: Callable[..., T], args: tuple[Any, ...]) -> T:
        try:
            return function(*args)
        except (ConnectTimeoutError, ReadTimeoutError) as e:
            raise TierTimeout(f"tier {self.name!r}: {e} ({self.endpoint_url or 'AWS'})") from e
        except EndpointConnectionError as e:
            raise TierUnavailable(f"tier {self.name!r}: {e}") from e
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            if code in ("SlowDown", "ServiceUnavailable", "InternalError", "503", "500"):
                raise TierUnavailable(f"tier {self.name!r}: {code}: {e}") from e
            raise TierError(f"tier {self.name!r}: {e}") from e
        except BotoCoreError as e:
            raise TierUnavailable(f"tier {self.name!r}: {e}") from e

    # -- primitives -----------------------------------------------------------------------------

    async def _read(self, key: BlockKey, limit: int) -> Buffer | None:
        await self._load_packs()
        with self._lock:
            pending = self._pending.get(key)
            packed = self._packed.get(key)
        if pending is not None:
            return pending
        if packed is not None:
            pack, offset, length = packed
            if length > limit:
                raise Corrupt("length", f"pack {pack} gives it {length} bytes, at most {limit}")
            blob = await self._run(self._get_range, pack, offset, length)
            if blob is not None:
                return blob
        return await self._run(self._get, self._name(key), limit)

    async def _read_head(self, key: BlockKey, n: int) -> tuple[Buffer, int] | None:
        await self._load_packs()
        with self._lock:
            pending = self._pending.get(key)
            packed = self._packed.get(key)
        if pending is not None:
            return pending[:n], len(pending)
        if packed is not None:
            pack, offset, length = packed
            head = await self._run(self._get_range, pack, offset, min(n, length))
            if head is not None:
                return head, length
        return await self._run(self._get_head, self._name(key), n)

    async def _write(self, key: BlockKey, parts: Sequence[Buffer]) -> None:
        blob = b"".join(parts)
        if self.blocks_per_object == 1:
            await self._run(self._put, self._name(key), blob)
            return
        # No wait for the packs to load: a block packed before the load ends keeps its new
        # place (the load never overrides a key it finds indexed), and puts are not held up.
        with self._lock:
            self._pending[key] = blob
            batch = None
            if len(self._pending) >= self.blocks_per_object:
                batch, self._pending = self._pending, {}
        if batch is not None:
            await self._write_pack(batch)

    async def _delete(self, key: BlockKey) -> bool:
        await self._load_packs()
        forgotten = False
        empty_pack = None
        with self._lock:
            if self._pending.pop(key, None) is not None:
                forgotten = True
            packed = self._packed.pop(key, None)
            if packed is not None:
                forgotten = True
                members = self._pack_members.get(packed[0], set())
                members.discard(key)
                if not members:
                    empty_pack = packed[0]
                    self._pack_members.pop(packed[0], None)
        if empty_pack is not None:
            await self._run(self._delete_object, empty_pack)
        existed = await self._run(self._head, self._name(key))
        if existed:
            await self._run(self._delete_object, self._name(key))
        return existed or forgotten

    async def _contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        await self._load_packs()
        with self._lock:
            known = [k in self._pending or k in self._packed for k in keys]
        heads = await asyncio.gather(
            *(
                self._run(self._head, self._name(k))
                for k, found in zip(keys, known, strict=True)
                if not found
            )
        )
        answers = iter(heads)
        return [found or next(answers) for found in known]

    async def _list(self) -> AsyncIterator[BlockKey]:
        await self._load_packs()
        with self._lock:
            seen = set(self._pending) | set(self._packed)
        for key in seen:
            yield key
        for name, _ in await self._run(self._list_objects, self._base):
            found = self._key_of(name)
            if found is not None and found not in seen:
                yield found

    async def _entries(self) -> AsyncIterator[ObjectInfo]:
        await self._load_packs()
        with self._lock:
            packed = dict(self._packed)
            pending = {k: len(b) for k, b in self._pending.items()}
        for key, size in pending.items():
            yield ObjectInfo(key, size)
        for key, (_, _, length) in packed.items():
            if key not in pending:
                yield ObjectInfo(key, length)
        for name, size, modified in await self._run(self._list_objects_meta, self._base):
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
        for name, _ in await self._run(self._list_objects, self.prefix):
            part = name[len(self.prefix) :].split("/", 1)[0]
            if len(part) == 32:
                try:
                    found.add(bytes.fromhex(part))
                except ValueError:
                    continue
        return sorted(found)

    async def _stat(self) -> TierStat:
        await self._load_packs()
        objects = await self._run(self._list_objects, self._base)
        singles = [(n, size) for n, size in objects if "/packs/" not in n]
        with self._lock:
            packed_bytes = sum(length for _, _, length in self._packed.values())
            pending_bytes = sum(len(b) for b in self._pending.values())
            count = len(self._packed) + len(self._pending)
        return TierStat(
            count + len(singles),
            packed_bytes + pending_bytes + sum(s for _, s in singles),
            self.capacity,
        )

    async def _close(self) -> None:
        loading, self._loading = self._loading, None
        if loading is not None and not loading.done():
            loading.cancel()  # its pool calls already queued end at the shutdown below
            if loading.get_loop() is asyncio.get_running_loop():
                await asyncio.wait([loading])
        try:
            with self._lock:
                batch, self._pending = self._pending, {}
            if batch:
                await self._write_pack(batch)
        finally:
            self._pool.shutdown()

    # -- packs ----------------------------------------------------------------------------------

    async def _write_pack(self, batch: dict[BlockKey, bytes]) -> None:
        index: dict[str, list[int]] = {}
        at = 0
        for key, blob in batch.items():
            index[key.hex()] = [at, len(blob)]
            at += len(blob)
        head = json.dumps(index, separators=(",", ":")).encode()
        prefix = len(head).to_bytes(4, "big") + head
        name = f"{self._base}packs/{uuid.uuid4().hex}"
        try:
            await self._run(self._put, name, prefix + b"".join(batch.values()))
        except TierError:
            with self._lock:  # keep the blocks for the next pack rather than lose them
                for key, blob in batch.items():
                    self._pending.setdefault(key, blob)
            raise
        with self._lock:
            members = self._pack_members.setdefault(name, set())
            for text, (offset, length) in index.items():
                block = key_from_hex(text)
                if block in self._pending:  # rewritten while this pack was in flight
                    continue
                old = self._packed.get(block)
                if old is not None:
                    self._pack_members.get(old[0], set()).discard(block)
                self._packed[block] = (name, len(prefix) + offset, length)
                members.add(block)

    async def _load_packs(self) -> None:
        """Wait, under the caller's deadline, for the one background load of the packs'
        indexes, starting it when none runs (the first call, or the last load failed)."""
        if self._packs_loaded:
            return
        loading = self._loading
        if (
            loading is None
            or loading.done()  # it failed: start it again
            or loading.get_loop() is not asyncio.get_running_loop()  # left on a closed loop
        ):
            loading = self._loading = asyncio.ensure_future(self._load_all())
            loading.add_done_callback(_retrieve)
        try:
            await asyncio.shield(loading)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if loading.cancelled() and task is not None and not task.cancelling():
                # `close` stopped the load: this caller was not cancelled, so it must not
                # see a cancellation
                raise TierUnavailable(f"tier {self.name!r}: closed while loading packs") from None
            raise

    async def _load_all(self) -> None:
        try:
            await self.refresh_packs()
        except TierError as e:
            log.warning(
                "tier %r: loading pack indexes failed (%s); retried at the next call", self.name, e
            )
            raise

    async def refresh_packs(self) -> None:
        """Read the index of every pack in the bucket not indexed yet (packs written by other
        processes, or before a restart), `PACK_LOADS` at a time, a page of the listing at a
        time. A pack whose index is not what kvtier writes (too large, too many entries, not a
        flat JSON object, entries that are not a key and a range inside the pack), or beyond
        `MAX_PACKED`, is ignored and counted (at each refresh that meets it); one bad pack
        never stops the others. A pack the server cannot serve now (`TierUnavailable`,
        `TierTimeout`) fails the whole refresh: the next one reads the packs still missing."""
        token: str | None = None
        while True:
            page, token = await self._run(self._list_page, f"{self._base}packs/", token)
            with self._lock:
                todo = iter([(n, size) for n, size in page if n not in self._pack_members])
            workers = [asyncio.ensure_future(self._index_packs(todo)) for _ in range(PACK_LOADS)]
            try:
                await asyncio.gather(*workers)
            finally:
                for worker in workers:  # after a failure, the others stop too
                    worker.cancel()
            if token is None:
                self._packs_loaded = True
                return

    async def _index_packs(self, todo: Iterator[tuple[str, int]]) -> None:
        for name, size in todo:
            with self._lock:
                full = len(self._packed) + len(self._pack_members) >= MAX_PACKED
            if full:
                self._refuse_beyond_bound(name)
                continue
            try:
                read = await self._read_pack_index(name, size)
            except (TierUnavailable, TierTimeout):
                raise
            except TierError as e:  # this object, not the server (a planted SSE-C object...)
                log.warning("tier %r: pack %s cannot be read (%s); ignored", self.name, name, e)
                self.counters["packs_refused"] += 1
                continue
            if isinstance(read, _Gone):  # deleted since it was listed
                continue
            if read is None:
                self.counters["packs_refused"] += 1
                log.warning("tier %r: pack %s has an unreadable index; ignored", self.name, name)
                continue
            start, entries = read
            with self._lock:
                if name in self._pack_members:  # indexed meanwhile, by another refresh
                    continue
                full = len(self._packed) + len(self._pack_members) + 1 + len(entries) > MAX_PACKED
                if not full:
                    members = self._pack_members.setdefault(name, set())
                    for block, offset, object_size in entries:
                        if block not in self._packed:
                            self._packed[block] = (name, start + offset, object_size)
                            members.add(block)
            if full:
                self._refuse_beyond_bound(name)

    def _refuse_beyond_bound(self, name: str) -> None:
        self.counters["packs_refused"] += 1
        if not self._bound_logged:
            self._bound_logged = True
            log.warning(
                "tier %r: %d blocks and packs indexed from the bucket's packs (MAX_PACKED);"
                " pack %s and any more are ignored, counted in packs_refused",
                self.name,
                MAX_PACKED,
                name,
            )

    async def _read_pack_index(
        self, name: str, size: int
    ) -> tuple[int, list[tuple[BlockKey, int, int]]] | None | _Gone:
        """(where the pack's objects start, its entries); None when the index is not one
        kvtier writes, `_GONE` when the pack no longer exists. Reads `PACK_HEAD` bytes, and
        then at most `MAX_PACK_INDEX` for an index that does not fit in them."""
        first = await self._run(self._get_range, name, 0, min(size, PACK_HEAD))
        if first is None:
            return _GONE
        if len(first) < 4:
            return None
        length = int.from_bytes(first[:4], "big")
        if length > MAX_PACK_INDEX or 4 + length > size:
            return None
        head = first[4 : 4 + length]
        if len(head) < length:
            rest = await self._run(self._get_range, name, 4, length)
            if rest is None:
                return _GONE
            head = rest
        if len(head) != length:
            return None
        entries = _pack_entries(head, size - 4 - length)
        return None if entries is None else (4 + length, entries)

    # -- boto3, in the pool ----------------------------------------------------------------------

    def _get(self, name: str, limit: int) -> bytes | None:
        """The object `name`; `Corrupt("length")` when it is larger than `limit`, known from
        the response's headers before its body is read."""
        try:
            response = self._client.get_object(Bucket=self.bucket, Key=name)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in _MISSING:
                return None
            raise
        body = response["Body"]
        size = int(response.get("ContentLength", 0))
        if size > limit:
            body.close()  # the connection goes; the body is never read
            raise Corrupt("length", f"object {name} of {size} bytes, at most {limit} expected")
        data: bytes = body.read(limit + 1)
        body.close()
        if len(data) > limit:
            raise Corrupt("length", f"object {name} is larger than {limit} bytes")
        return data

    def _get_head(self, name: str, n: int) -> tuple[bytes, int] | None:
        """The first `n` bytes of object `name` and its size (from `Content-Range`)."""
        try:
            response = self._client.get_object(
                Bucket=self.bucket, Key=name, Range=f"bytes=0-{n - 1}"
            )
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code")
            if code in _MISSING:
                return None
            if code == "InvalidRange":  # an empty object
                return b"", 0
            raise
        body = response["Body"]
        data: bytes = body.read(n)
        body.close()
        total = str(response.get("ContentRange", "")).rpartition("/")[2]
        return data, int(total) if total.isdigit() else len(data)

    def _get_range(self, name: str, offset: int, length: int) -> bytes | None:
        if length == 0:
            return b""
        try:
            response = self._client.get_object(
                Bucket=self.bucket, Key=name, Range=f"bytes={offset}-{offset + length - 1}"
            )
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in (*_MISSING, "InvalidRange"):
                return None
            raise
        body = response["Body"]
        data: bytes = body.read(length)  # a server that ignores the range sends no more
        body.close()
        return data

    def _head(self, name: str) -> bool:
        try:
            self._client.head_object(Bucket=self.bucket, Key=name)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in _MISSING:
                return False
            raise
        return True

    def _put(self, name: str, blob: bytes) -> None:
        if len(blob) <= self.multipart_threshold:
            self._client.put_object(Bucket=self.bucket, Key=name, Body=blob)
            return
        upload = self._client.create_multipart_upload(Bucket=self.bucket, Key=name)["UploadId"]
        try:
            parts = []
            view = memoryview(blob)
            for number, at in enumerate(range(0, len(blob), self.part_size), start=1):
                etag = self._client.upload_part(
                    Bucket=self.bucket,
                    Key=name,
                    UploadId=upload,
                    PartNumber=number,
                    Body=bytes(view[at : at + self.part_size]),
                )["ETag"]
                parts.append({"ETag": etag, "PartNumber": number})
            self._client.complete_multipart_upload(
                Bucket=self.bucket, Key=name, UploadId=upload, MultipartUpload={"Parts": parts}
            )
        except Exception:
            self._client.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload)
            raise

    def _delete_object(self, name: str) -> None:
        self._client.delete_object(Bucket=self.bucket, Key=name)

    def _list_page(
        self, prefix: str, token: str | None
    ) -> tuple[list[tuple[str, int]], str | None]:
        """One page of the names under `prefix` (`PACK_PAGE` at most) and the token of the
        next."""
        options = {"ContinuationToken": token} if token else {}
        page = self._client.list_objects_v2(
            Bucket=self.bucket, Prefix=prefix, MaxKeys=PACK_PAGE, **options
        )
        found = [(item["Key"], int(item["Size"])) for item in page.get("Contents", [])]
        more = page.get("NextContinuationToken") if page.get("IsTruncated") else None
        return found, more

    def _list_objects(self, prefix: str) -> list[tuple[str, int]]:
        return [(name, size) for name, size, _ in self._list_objects_meta(prefix)]

    def _list_objects_meta(self, prefix: str) -> list[tuple[str, int, float]]:
        found = []
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix
        )
        for page in pages:
            found += [
                (item["Key"], int(item["Size"]), item["LastModified"].timestamp())
                for item in page.get("Contents", [])
            ]
        return found

    # -- white-box hooks ------------------------------------------------------------------------

    def raw_put(self, key: BlockKey, blob: bytes) -> None:
        """Store object bytes as they are, as a single object (tests)."""
        self._client.put_object(Bucket=self.bucket, Key=self._name(key), Body=blob)

    def raw_get(self, key: BlockKey) -> bytes | None:
        """The stored object of `key`: its byte range in a pack, pending bytes, or the single
        object (tests)."""
        with self._lock:
            pending = self._pending.get(key)
            packed = self._packed.get(key)
        if pending is not None:
            return pending
        if packed is not None:
            return self._get_range(*packed)
        return self._get(self._name(key), 1 << 40)


class _Gone:
    """A pack deleted between its listing and the read of its index."""


_GONE = _Gone()


def _retrieve(task: asyncio.Task[None]) -> None:
    """Mark a load's failure as seen: the callers that waited got it, and nobody else needs
    asyncio's "exception was never retrieved" at garbage collection."""
    if not task.cancelled():
        task.exception()


def _pack_entries(head: bytes, room: int) -> list[tuple[BlockKey, int, int]] | None:
    """A pack index's entries (key, offset, length), each range inside the `room` bytes after
    the index; None when it is not an index kvtier writes: a flat JSON object of at most
    `MAX_PACK_ENTRIES` entries, one list each (counted before parsing, so a wide index costs
    no parse; a deep one makes the parser raise RecursionError)."""
    if head.count(b"[") > MAX_PACK_ENTRIES:
        return None
    try:
        index = json.loads(head)
    except (ValueError, RecursionError):
        return None
    if not isinstance(index, dict) or not index:
        return None
    entries = []
    for text, where in index.items():
        if not (
            isinstance(where, list)
            and len(where) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in where)
            and where[0] + where[1] <= room
        ):
            return None
        try:
            entries.append((key_from_hex(text), where[0], where[1]))
        except KeyFormatError:
            return None
    return entries
