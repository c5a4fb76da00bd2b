"""The S3 tier's calls to its bucket: boto3 in a bounded pool of threads, library errors
translated to kvtier's at this edge.

One boto3 client (thread-safe) serves the pool; retries use botocore's standard mode. Objects
above `multipart_threshold` go up in parts. A missing object is None (or False), never an
error; an object larger than the reader can use is refused from the response's headers before
its body is read (`CorruptObject("length")`).
"""

from __future__ import annotations

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

from tiering.errors import CorruptObject, TierError, TierTimeout, TierUnavailable
from tiers.threads import IOThreads

__all__ = ["Bucket"]

T = TypeVar("T")

_MISSING = ("404", "NoSuchKey", "NotFound")


class Bucket:
    """One bucket, called from the runtime's event loop; each call runs on one of the pool's
    `concurrency` threads."""

    def __init__(
        self,
        *,
        tier: str,
        bucket: str,
        endpoint_url: str | None,
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
            config=BotoConfig(
                retries={"mode": "standard", "max_attempts": retries},
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                max_pool_connections=concurrency,
            ),
        )
        self._pool = IOThreads(concurrency, f"kvtier-{tier}")

    def shutdown(self) -> None:
        """Stop the pool's threads, after the calls already queued."""
        self._pool.shutdown()

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

    async def put(self, name: str, blob: bytes) -> None:
        await self._run(self._put, name, blob)

    async def delete(self, name: str) -> None:
        await self._run(self._delete, name)

    async def list_page(
        self, prefix: str, token: str | None, size: int
    ) -> tuple[list[tuple[str, int]], str | None]:
        """One page of (name, size) under `prefix` (`size` at most) and the token of the
        next (None after the last)."""
        return await self._run(self._list_page, prefix, token, size)

    async def list_page_meta(
        self, prefix: str, token: str | None, size: int
    ) -> tuple[list[tuple[str, int, float]], str | None]:
        """`list_page` with each object's time of writing (LastModified, as Unix time)."""
        return await self._run(self._list_page_meta, prefix, token, size)

    async def list_objects(self, prefix: str) -> list[tuple[str, int]]:
        """(name, size) of every object under `prefix`."""
        found = await self._run(self._list_objects_meta, prefix)
        return [(name, size) for name, size, _ in found]

    async def list_objects_meta(self, prefix: str) -> list[tuple[str, int, float]]:
        """(name, size, modified as Unix time) of every object under `prefix`."""
        return await self._run(self._list_objects_meta, prefix)

    # -- boto3, in the pool ----------------------------------------------------------------------

    async def _run(self, function: Callable[..., T], *args: Any) -> T:
        return await self._pool.run(self._guard, function, args)

    def _guard(self, function: Callable[..., T], args: tuple[Any, ...]) -> T:
        try:
            return function(*args)
        except (ConnectTimeoutError, ReadTimeoutError) as e:
            raise TierTimeout(f"tier {self.tier!r}: {e} ({self.endpoint_url or 'AWS'})") from e
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

    def _delete(self, name: str) -> None:
        self._client.delete_object(Bucket=self.bucket, Key=name)

    def _list_page(
        self, prefix: str, token: str | None, size: int
    ) -> tuple[list[tuple[str, int]], str | None]:
        options = {"ContinuationToken": token} if token else {}
        page = self._client.list_objects_v2(
            Bucket=self.bucket, Prefix=prefix, MaxKeys=size, **options
        )
        found = [(item["Key"], int(item["Size"])) for item in page.get("Contents", [])]
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
