"""The S3 tier's calls to its bucket: boto3 in a bounded pool of threads, library errors
translated to kvtier's at this edge.

One boto3 client (thread-safe) serves the pool; retries use botocore's standard mode. Objects
above `multipart_threshold` go up in parts. A missing object is None (or False), never an
error; an object larger than the reader can use is refused from the response's headers before
its body is read (`CorruptObject("length")`).

Conditional writes (`If-None-Match: *`, `If-Match: <etag>`) answer whether they wrote: a put
the server refused for its condition (412, or AWS's 409 for a concurrent conditional write) is
None or False, not an error. The server's clock is estimated from the `Date` header of its
answers (`server_time`), so that times engines compare (pack names, the lease) are the
store's, not each host's.

Every call ends within `deadline` seconds of the wall clock (a multipart put, that many per
part), whatever the server does: botocore's timeouts are per read, so a server that trickles an
answer a byte at a time, each in time, would hold a call for ever. The call ends with
`TierTimeout`; its thread, blocked in the socket, is left to end with it (listings page from
the loop, a call per page, so a long listing is not one call). `shutdown` waits at most
`CLOSE_WAIT` for the threads, so a close ends too.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import time
from collections.abc import Callable
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
from botocore.exceptions import SSLError as BotoSSLError

from tiering.errors import CorruptObject, TierError, TierTimeout, TierUnavailable, TlsError
from tiering.tier.threads import IOThreads
from tiers.tls import tls_cause

__all__ = ["Bucket", "Listed"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_MISSING = ("404", "NoSuchKey", "NotFound")
_CONDITION_FAILED = ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")
_UNSUPPORTED = ("NotImplemented", "501")
DELETE_BATCH = 1000
"""Names one `DeleteObjects` request removes (S3's largest)."""

CLOSE_WAIT = 1.0
"""Seconds `shutdown` waits for the pool's threads (calls whose callers have gone: a put's
object lands whole or not at all, whenever its thread ends)."""

Listed = tuple[str, int, float]
"""An object of a listing: (name, size, last modified: Unix seconds of the server's clock)."""


class Bucket:
    """One bucket, called from the runtime's event loop; each call runs on one of the pool's
    `concurrency` threads."""

    def __init__(
        self,
        *,
        tier: str,
        bucket: str,
        endpoint_url: str | None,
        ca_bundle: str | None = None,
        region: str | None,
        access_key: str | None,
        secret_key: str | None,
        session_token: str | None,
        multipart_threshold: int,
        part_size: int,
        retries: int,
        connect_timeout: float,
        read_timeout: float,
        concurrency: int,
    ) -> None:
        """`tier`: the tier's name, for messages and the pool's thread names."""
        self.tier = tier
        self.bucket = bucket
        self.endpoint_url = endpoint_url
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        self._client = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=region or "us-east-1",
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            aws_session_token=session_token,
            verify=ca_bundle if ca_bundle is not None else True,
            config=BotoConfig(
                retries={"mode": "standard", "max_attempts": retries},
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                max_pool_connections=concurrency,
            ),
        )
        self._pool = IOThreads(concurrency, f"kvtier-{tier}")
        attempts = max(1, retries)
        self.deadline = attempts * (connect_timeout + read_timeout) + sum(
            min(20, 2**i) for i in range(attempts - 1)
        )
        """The longest a call may take: each attempt's connection and answer, and botocore's
        pauses between attempts (at most 2**i seconds, 20 at most, standard mode)."""
        self.conditional = True
        """Whether single-object puts may carry `If-None-Match: *` (False once the server
        answered that it does not implement it: puts are plain ones from then on)."""
        self._offset: float | None = None

    def shutdown(self) -> None:
        """Stop the pool's threads, after the calls already queued, waiting `CLOSE_WAIT` at
        most: a thread still blocked in a socket then is left behind (a daemon), said once."""
        left = self._pool.shutdown(wait=CLOSE_WAIT)
        if left:
            log.warning(
                "tier %r: %d calls to %s still unanswered at close, left behind",
                self.tier,
                left,
                self.endpoint_url or "S3",
            )

    # -- calls from the event loop ----------------------------------------------------------------

    async def get(self, name: str, limit: int) -> bytes | None:
        """The object `name`; `CorruptObject("length")` when it is larger than `limit`, known
        from the response's headers before its body is read."""
        return await self._run(self._get, name, limit)

    async def get_head(self, name: str, n: int) -> tuple[bytes, int] | None:
        """The first `n` bytes of object `name` and its size (from `Content-Range`)."""
        return await self._run(self._get_head, name, n)

    async def get_range(self, name: str, offset: int, length: int) -> bytes | None:
        """`length` bytes of object `name` from `offset`; None when it (or the range) is gone."""
        return await self._run(self._get_range, name, offset, length)

    async def head(self, name: str) -> bool:
        """Whether object `name` exists."""
        return await self._run(self._head, name)

    async def put(self, name: str, blob: bytes, once: bool = False) -> bool:
        """Write object `name`; with `once`, only where none exists (`If-None-Match: *`):
        False when one did and nothing was written (a server that ignores the header
        overwrites, one that rejects it gets a plain put)."""
        requests = 1  # (a multipart put: its parts, and its creation and completion)
        if len(blob) > self.multipart_threshold:
            requests = -(-len(blob) // self.part_size) + 2
        return await self._run(self._put, name, blob, once, requests=requests)

    async def put_if_absent(self, name: str, blob: bytes) -> str | None:
        """Create object `name` (a single small put) unless one exists: its ETag, or None."""
        return await self._run(self._put_conditional, name, blob, {"IfNoneMatch": "*"})

    async def put_if_match(self, name: str, blob: bytes, etag: str) -> str | None:
        """Replace object `name` if it is still the version `etag`: the new ETag, or None."""
        return await self._run(self._put_conditional, name, blob, {"IfMatch": etag})

    async def head_meta(self, name: str) -> tuple[str, float, float] | None:
        """(ETag, last modified, the server's time of the answer), both times the server's
        own (Unix seconds, as precise as its headers: a second); None when absent."""
        return await self._run(self._head_meta, name)

    async def get_meta(
        self, name: str, limit: int
    ) -> tuple[bytes | None, str, float, float] | None:
        """Object `name` with, from the same answer, its ETag, last modified and the server's
        time of the answer (as `head_meta`); its body is None, never read, when it is larger
        than `limit`; None when absent."""
        return await self._run(self._get_meta, name, limit)

    async def delete_if_match(self, name: str, etag: str) -> bool:
        """Delete object `name` if it is still the version `etag`: whether it was."""
        return await self._run(self._delete_if_match, name, etag)

    async def delete_names(self, names: list[str]) -> int:
        """Delete `names` (at most `DELETE_BATCH`) in one request: how many failed."""
        return await self._run(self._delete_names, names)

    async def delete(self, name: str) -> None:
        await self._run(self._delete, name)

    async def list_page(
        self, prefix: str, token: str | None, size: int, after: str | None = None
    ) -> tuple[list[Listed], str | None]:
        """One page of (name, size, modified) under `prefix` (`size` at most; only names
        sorting after `after`, when given) and the token of the next (None after the last)."""
        return await self._run(self._list_page, prefix, token, size, after)

    def server_time(self) -> float:
        """The server's clock now (Unix seconds), as its last answers' `Date` headers tell
        (to about a second); this host's clock before any answer."""
        return time.time() + (self._offset or 0.0)

    @property
    def clock_known(self) -> bool:
        """Whether `server_time` has been set from an answer of the server."""
        return self._offset is not None

    async def list_page_meta(
        self, prefix: str, token: str | None, size: int
    ) -> tuple[list[tuple[str, int, float]], str | None]:
        """`list_page` with each object's time of writing (LastModified, as Unix time)."""
        return await self._run(self._list_page_meta, prefix, token, size)

    async def list_objects(self, prefix: str) -> list[tuple[str, int]]:
        """(name, size) of every object under `prefix`."""
        found = await self.list_objects_meta(prefix)
        return [(name, size) for name, size, _ in found]

    async def list_objects_meta(self, prefix: str) -> list[tuple[str, int, float]]:
        """(name, size, modified as Unix time) of every object under `prefix`, a page (of
        S3's largest) per call."""
        found: list[tuple[str, int, float]] = []
        token: str | None = None
        while True:
            page, token = await self.list_page_meta(prefix, token, DELETE_BATCH)
            found += page
            if token is None:
                return found

    # -- boto3, in the pool ----------------------------------------------------------------------

    async def _run(self, function: Callable[..., T], *args: Any, requests: int = 1) -> T:
        """`function(*args)` in the pool, `TierTimeout` past `requests` deadlines."""
        limit = requests * self.deadline
        try:
            async with asyncio.timeout(limit):
                return await self._pool.run(self._guard, function, args)
        except TimeoutError as e:
            if isinstance(e, TierError):
                raise
            raise TierTimeout(
                f"tier {self.tier!r}: no answer within {limit:g}s ({self.endpoint_url or 'AWS'})"
            ) from e

    def _guard(self, function: Callable[..., T], args: tuple[Any, ...]) -> T:
        try:
            return function(*args)
        except (ConnectTimeoutError, ReadTimeoutError) as e:
            raise TierTimeout(f"tier {self.tier!r}: {e} ({self.endpoint_url or 'AWS'})") from e
        except BotoSSLError as e:  # never retried over plaintext
            cause = e.kwargs.get("error")
            detail = tls_cause(cause) if isinstance(cause, BaseException) else str(e)
            raise TlsError(f"tier {self.tier!r}: TLS to {self.endpoint_url}: {detail}") from e
        except EndpointConnectionError as e:
            raise TierUnavailable(f"tier {self.tier!r}: {e}") from e
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            if code in ("SlowDown", "ServiceUnavailable", "InternalError", "503", "500"):
                raise TierUnavailable(f"tier {self.tier!r}: {code}: {e}") from e
            raise TierError(f"tier {self.tier!r}: {e}") from e
        except BotoCoreError as e:
            raise TierUnavailable(f"tier {self.tier!r}: {e}") from e

    def _get(self, name: str, limit: int) -> bytes | None:
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
            raise CorruptObject(
                "length", f"object {name} of {size} bytes, at most {limit} expected"
            )
        data: bytes = body.read(limit + 1)
        body.close()
        if len(data) > limit:
            raise CorruptObject("length", f"object {name} is larger than {limit} bytes")
        return data

    def _get_head(self, name: str, n: int) -> tuple[bytes, int] | None:
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

    def _clock(self, response: Any) -> None:
        """Set the server's clock from an answer's `Date` (a second's precision: its middle)."""
        try:
            date = response["ResponseMetadata"]["HTTPHeaders"]["date"]
            self._offset = email.utils.parsedate_to_datetime(date).timestamp() + 0.5 - time.time()
        except (KeyError, TypeError, ValueError, IndexError):
            return

    def _put(self, name: str, blob: bytes, once: bool) -> bool:
        condition = {"IfNoneMatch": "*"} if once and self.conditional else {}
        try:
            self._put_object(name, blob, condition)
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            if condition and code in _CONDITION_FAILED:
                return False
            if not (condition and code in _UNSUPPORTED):
                raise
            self.conditional = False
            log.warning(
                "tier %r: %s does not implement conditional puts (%s); puts overwrite",
                self.tier,
                self.endpoint_url or "S3",
                code,
            )
            self._put_object(name, blob, {})
        return True

    def _put_object(self, name: str, blob: bytes, condition: dict[str, str]) -> None:
        if len(blob) <= self.multipart_threshold:
            self._clock(
                self._client.put_object(Bucket=self.bucket, Key=name, Body=blob, **condition)
            )
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
                Bucket=self.bucket,
                Key=name,
                UploadId=upload,
                MultipartUpload={"Parts": parts},
                **condition,
            )
        except Exception:
            self._client.abort_multipart_upload(Bucket=self.bucket, Key=name, UploadId=upload)
            raise

    def _put_conditional(self, name: str, blob: bytes, condition: dict[str, str]) -> str | None:
        try:
            response = self._client.put_object(Bucket=self.bucket, Key=name, Body=blob, **condition)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code", "") in _CONDITION_FAILED:
                return None
            raise
        self._clock(response)
        return str(response.get("ETag", "")) or None

    def _head_meta(self, name: str) -> tuple[str, float, float] | None:
        try:
            response = self._client.head_object(Bucket=self.bucket, Key=name)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in _MISSING:
                return None
            raise
        self._clock(response)
        modified = response.get("LastModified")
        now = self.server_time()
        return (
            str(response.get("ETag", "")),
            now if modified is None else modified.timestamp(),
            now,
        )

    def _get_meta(self, name: str, limit: int) -> tuple[bytes | None, str, float, float] | None:
        try:
            response = self._client.get_object(Bucket=self.bucket, Key=name)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in _MISSING:
                return None
            raise
        self._clock(response)
        body = response["Body"]
        data: bytes | None = None
        if int(response.get("ContentLength", 0)) <= limit:
            data = body.read(limit + 1)
            if len(data) > limit:  # a length the headers did not give
                data = None
        body.close()  # what is left unread: the connection goes
        modified = response.get("LastModified")
        now = self.server_time()
        return (
            data,
            str(response.get("ETag", "")),
            now if modified is None else modified.timestamp(),
            now,
        )

    def _delete_if_match(self, name: str, etag: str) -> bool:
        try:
            self._client.delete_object(Bucket=self.bucket, Key=name, IfMatch=etag)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code", "") in (*_CONDITION_FAILED, *_MISSING):
                return False
            raise
        return True

    def _delete(self, name: str) -> None:
        self._client.delete_object(Bucket=self.bucket, Key=name)

    def _delete_names(self, names: list[str]) -> int:
        if not names:
            return 0
        response = self._client.delete_objects(
            Bucket=self.bucket,
            Delete={"Objects": [{"Key": n} for n in names[:DELETE_BATCH]], "Quiet": True},
        )
        return len(response.get("Errors", []) or [])

    def _list_page(
        self, prefix: str, token: str | None, size: int, after: str | None
    ) -> tuple[list[Listed], str | None]:
        options = {"ContinuationToken": token} if token else {}
        if after is not None:
            options["StartAfter"] = after
        page = self._client.list_objects_v2(
            Bucket=self.bucket, Prefix=prefix, MaxKeys=size, **options
        )
        self._clock(page)
        found = [
            (item["Key"], int(item["Size"]), item["LastModified"].timestamp())
            for item in page.get("Contents", [])
        ]
        more = page.get("NextContinuationToken") if page.get("IsTruncated") else None
        return found, more

    def _list_page_meta(
        self, prefix: str, token: str | None, size: int
    ) -> tuple[list[tuple[str, int, float]], str | None]:
        options = {"ContinuationToken": token} if token else {}
        page = self._client.list_objects_v2(
            Bucket=self.bucket, Prefix=prefix, MaxKeys=size, **options
        )
        found = [
            (item["Key"], int(item["Size"]), item["LastModified"].timestamp())
            for item in page.get("Contents", [])
        ]
        more = page.get("NextContinuationToken") if page.get("IsTruncated") else None
        return found, more
