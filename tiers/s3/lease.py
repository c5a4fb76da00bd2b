"""The sweeper's lease on a bucket prefix (`Lease`, runtime's event loop: the sweeper's task;
its requests in the tier's thread pool), elected by the store's own conditional writes.

The lease is one object, `<prefix>kvtier-lease` (with a deployment's secret,
`<prefix>kvtier-lease-<label>`, below). An engine takes it by creating it
(`If-None-Match: *`), keeps it by rewriting it over its own version (`If-Match: <etag>`) every
`LEASE_TTL / 3`, and takes it over once it has not been rewritten for `LEASE_TTL`, by rewriting
it over the version it saw (`If-Match`): of several engines trying at once, the store lets one
succeed. Whether a lease lapsed is judged by the server's clock alone (its LastModified against
the `Date` of the answer that gave it, both to a second), never by this host's: writers' clocks
may disagree. The holder counts itself the holder until `LEASE_TTL - LEASE_MARGIN` after it
sent its last successful write, by its own monotonic clock: that write reached the server after
it was sent, so no other engine judges the lease lapsed before then.

Every body is new (the holder's id, a count, a random nonce, the server's time of the write):
an S3 ETag is the body's MD5, and two engines writing the same bytes would share a version.

Without a secret, what a body says is for operators; a reader never reads it: a planted lease
object is judged by its LastModified like any other, so each rewrite by a writer of the bucket
holds the sweep off one `LEASE_TTL`. With one (`lease_key`), every body ends with an
HMAC-SHA256 over the bucket, the lease's name and the body, and a reader takes (and counts,
`leases_forged`) a lease over at once, over the version it read, when it is not one this
deployment's engines wrote: its MAC is absent or wrong, or it is larger than `LEASE_BYTES`
(never read). An authenticated body is judged by the older of its LastModified and the
server's time it carries, so a genuine body written again later (a replay) lapses with the
write it came from; one naming this engine is its own, written again by someone else, and is
taken back at once. The name carries a label of the key, so deployments with different secrets
(and those without one) on one prefix never contend for one object: each elects a sweeper.

Whether the server honours the conditions is probed once (`probe`): a server that ignores them
would let every engine believe it holds the lease.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket
import time
from collections import Counter

from tiering.errors import TierError, TierTimeout, TierUnavailable
from tiers.s3.client import Bucket

__all__ = ["LEASE_BYTES", "LEASE_MARGIN", "LEASE_NAME", "LEASE_TTL", "Lease", "lease_key"]

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
LEASE_BYTES = 4096
"""The largest lease body a reader with a secret reads (one is about 250 bytes)."""

_KEY_DOMAIN = b"kvtier S3 sweeper lease v1\0"


def lease_key(mac: bytes | None) -> bytes | None:
    """The key a lease is authenticated with, derived from a deployment's object MAC key
    (`tiering.tier.format.mac_key`; None: no secret, no authentication)."""
    return None if mac is None else hashlib.sha256(_KEY_DOMAIN + mac).digest()


class Lease:
    """One engine's side of the lease on `prefix` of `bucket` (runtime's event loop)."""

    def __init__(
        self,
        bucket: Bucket,
        prefix: str,
        *,
        tier: str,
        writer: bytes,
        counters: Counter[str],
        mac: bytes | None = None,
    ) -> None:
        """`mac`: the deployment's object MAC key (`tiering.tier.format.mac_key`), from which the
        lease's key is derived (`lease_key`); None: no secret, judged by LastModified alone."""
        self.bucket = bucket
        self._key = lease_key(mac)
        self.name = f"{prefix}{LEASE_NAME}"
        if self._key is not None:
            label = hmac.new(self._key, b"lease name", hashlib.sha256).hexdigest()[:16]
            self.name += f"-{label}"
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
            version = await self._lapsed()
            if version is None:
                return False
            sent = time.monotonic()
            etag = await self.bucket.put_if_match(self.name, self._body(), version)
            if etag is None:
                return False  # another engine took it over first
        self._kept(etag, sent)
        self.counters["leases_taken"] += 1
        log.info("tier %r: holds the sweeper's lease %s", self.tier, self.name)
        return True

    async def _lapsed(self) -> str | None:
        """The version of the lease object when it may be taken over, else None (held, or
        released meanwhile: the next try creates it)."""
        if self._key is None:
            seen = await self.bucket.head_meta(self.name)
            if seen is None or not seen[0]:
                return None
            version, modified, now = seen
            return version if now - modified >= LEASE_TTL + CLOCK_STEP else None
        got = await self.bucket.get_meta(self.name, LEASE_BYTES)
        if got is None or not got[1]:
            return None
        body, version, modified, now = got
        lease = None if body is None else self._opened(body)
        if lease is None:
            self._forged("not written with this deployment's secret")
            return version
        if lease.get("holder") == self.writer.hex():
            return version  # this engine's own, written again by another: nobody holds it
        written = lease.get("t")
        if not isinstance(written, int | float) or written > modified:
            written = modified
        elif modified - written > LEASE_TTL:
            self._forged("a lapsed lease written again")
        return version if now - written >= LEASE_TTL + CLOCK_STEP else None

    def _opened(self, body: bytes) -> dict[str, object] | None:
        """What an authenticated `body` says (empty when it is not this version's JSON); None
        when its MAC does not verify."""
        signed, newline, tag = body.rpartition(b"\n")
        if not newline or not hmac.compare_digest(tag, self._mac(signed)):
            return None
        try:
            lease = json.loads(signed)
        except ValueError:
            return {}
        return lease if isinstance(lease, dict) else {}

    def _mac(self, signed: bytes) -> bytes:
        assert self._key is not None
        bound = f"{self.bucket.bucket}/{self.name}".encode() + b"\0" + signed
        return hmac.new(self._key, bound, hashlib.sha256).hexdigest().encode()

    def _forged(self, why: str) -> None:
        self.counters["leases_forged"] += 1
        log.log(
            logging.WARNING if self.counters["leases_forged"] == 1 else logging.INFO,
            "tier %r: the sweeper's lease %s is %s: taken over",
            self.tier,
            self.name,
            why,
        )

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
        lease: dict[str, object] = {
            "holder": self.writer.hex(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "n": self._count,
            "nonce": os.urandom(8).hex(),
        }
        if self.bucket.clock_known:  # the server's time; this host's is no use to a reader
            lease["t"] = round(self.bucket.server_time(), 3)
        signed = json.dumps(lease).encode()
        return signed if self._key is None else signed + b"\n" + self._mac(signed)
