"""The sweeper's lease on a bucket prefix (`Lease`, runtime's event loop: the sweeper's task;
its requests in the tier's thread pool), elected by the store's own conditional writes.

The lease is one object, `<prefix>kvtier-lease`. An engine takes it by creating it
(`If-None-Match: *`), keeps it by rewriting it over its own version (`If-Match: <etag>`) every
`LEASE_TTL / 3`, and takes it over once it has not been rewritten for `LEASE_TTL`, by rewriting
it over the version it saw (`If-Match`): of several engines trying at once, the store lets one
succeed. Whether a lease lapsed is judged by the server's clock alone (its LastModified against
the `Date` of the answer that gave it, both to a second), never by this host's: writers' clocks
may disagree. The holder counts itself the holder until `LEASE_TTL - LEASE_MARGIN` after it
sent its last successful write, by its own monotonic clock: that write reached the server after
it was sent, so no other engine judges the lease lapsed before then.

Every body is new (the holder's id, a count, a random nonce): an S3 ETag is the body's MD5, and
two engines writing the same bytes would share a version. What a body says (holder, host, pid)
is for operators; a reader never believes it: a planted lease object is judged by its
LastModified like any other, so it holds the sweep off for one `LEASE_TTL` per rewrite.

Whether the server honours the conditions is probed once (`probe`): a server that ignores them
would let every engine believe it holds the lease.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections import Counter

from tiering.errors import TierError, TierTimeout, TierUnavailable
from tiers.s3.client import Bucket

__all__ = ["LEASE_MARGIN", "LEASE_NAME", "LEASE_TTL", "Lease"]

log = logging.getLogger(__name__)

LEASE_NAME = "kvtier-lease"
"""The lease object's name under the tier's prefix (outside every namespace's names)."""
LEASE_TTL = 10.0
"""Seconds a lease lasts without being rewritten."""
LEASE_MARGIN = 1.0
"""Seconds before its lapse by the server's clock that a holder stops counting itself the
holder (the clocks' rates, the second of precision of the server's times)."""
CLOCK_STEP = 1.0
"""The precision of the server's LastModified and Date (HTTP dates: a second)."""


class Lease:
    """One engine's side of the lease on `prefix` of `bucket` (runtime's event loop)."""

    def __init__(
        self, bucket: Bucket, prefix: str, *, tier: str, writer: bytes, counters: Counter[str]
    ) -> None:
        self.bucket = bucket
        self.name = f"{prefix}{LEASE_NAME}"
        self.tier = tier
        self.writer = writer
        self.counters = counters
        self._etag: str | None = None
        self._valid_until = 0.0
        self._renew_at = 0.0
        self._count = 0
        self.supported: bool | None = None
        """Whether the server honours conditional puts (None until `probe`)."""

    @property
    def held(self) -> bool:
        """Whether this engine holds the lease now (by its own monotonic clock)."""
        return self._etag is not None and time.monotonic() < self._valid_until

    async def probe(self) -> bool:
        """Whether the server honours `If-None-Match: *`: a second conditional create of a
        probe object must be refused. Once per tier (`supported`)."""
        if self.supported is None:
            name = f"{self.name}-probe-{self.writer.hex()}"
            try:
                first = await self.bucket.put_if_absent(name, b"probe")
                second = await self.bucket.put_if_absent(name, b"probe again")
            except (TierUnavailable, TierTimeout):
                raise
            except TierError as e:  # a server that rejects the header outright
                log.warning("tier %r: conditional puts refused by the server (%s)", self.tier, e)
                first = second = None
                self.supported = False
            else:
                self.supported = first is not None and second is None
            await self.bucket.delete(name)
        return self.supported

    async def keep(self) -> bool:
        """Take, keep or take over the lease as due: whether this engine holds it now. At
        most two requests; a request that fails leaves what was held until it lapses."""
        if self._etag is not None:
            if time.monotonic() < self._renew_at:
                return self.held
            sent = time.monotonic()
            try:
                etag = await self.bucket.put_if_match(self.name, self._body(), self._etag)
            except TierError:
                if not self.held:
                    self._etag = None
                raise
            if etag is not None:
                self._kept(etag, sent)
                return True
            self._etag = None  # it lapsed and another engine took it
            self.counters["lease_lost"] += 1
            log.warning("tier %r: the sweeper's lease %s was taken over", self.tier, self.name)
        sent = time.monotonic()
        etag = await self.bucket.put_if_absent(self.name, self._body())
        if etag is None:
            seen = await self.bucket.head_meta(self.name)
            if seen is None or not seen[0]:
                return False  # released meanwhile (the next try creates it), or no version
            version, modified, now = seen
            if now - modified < LEASE_TTL + CLOCK_STEP:
                return False
            sent = time.monotonic()
            etag = await self.bucket.put_if_match(self.name, self._body(), version)
            if etag is None:
                return False  # another engine took it over first
        self._kept(etag, sent)
        self.counters["leases_taken"] += 1
        log.info("tier %r: holds the sweeper's lease %s", self.tier, self.name)
        return True

    async def release(self) -> None:
        """Give the lease up (the tier closes), if held: deleted only if it is still this
        engine's version; a failure leaves it to lapse."""
        etag, self._etag = self._etag, None
        if etag is not None and time.monotonic() < self._valid_until:
            try:
                await self.bucket.delete_if_match(self.name, etag)
            except TierError as e:
                log.info("tier %r: the lease is left to lapse (%s)", self.tier, e)

    def _kept(self, etag: str, sent: float) -> None:
        self._etag = etag
        self._valid_until = sent + LEASE_TTL - LEASE_MARGIN
        self._renew_at = sent + LEASE_TTL / 3

    def _body(self) -> bytes:
        self._count += 1
        return json.dumps(
            {
                "holder": self.writer.hex(),
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "n": self._count,
                "nonce": os.urandom(8).hex(),
            }
        ).encode()
