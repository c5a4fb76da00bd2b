"""One engine's S3 tier in a process of its own, for tests/tiers/test_s3_fleet.py (a worker
process, its own event loop): `python -m tests.tiers.s3_fleet_worker '<json>'`.

It builds the tier, makes one call (the pack index loads), writes `ready` to its log, waits for
the `go` file, then does its `mode`:

- `write`: puts blocks `keys` (`key(i)`, `payload(size, i)`), `interval` seconds apart, logging
  `put i t` after each put returns (t: this host's Unix time); then keeps running `linger`
  seconds (its background tasks go on: pack writes, refreshes, the sweeper).
- `read`: gets blocks `keys` (`get`, each checked against `payload(size, i)`), `rounds` times
  (1 by default) `interval` seconds apart, logging `got i t` after each hit; then keeps running
  `linger` seconds (its record of reads is written every `reads_interval` and at close).
- `watch`: asks `contains` for `keys` every `poll` seconds, logging `seen i t` the first time
  each is found, until all are or `linger` seconds pass.

- `forge`: no engine but a stranger who can write the bucket: every `interval` seconds for
  `linger` seconds, rewrites `<prefix>kvtier-lease` and every lease object it lists under the
  prefix (`kvtier-lease-*`, probes aside), with a new forged body (`forge: "garbage"`: a
  lease-like JSON line and a random MAC) or the first body it read of that object
  (`forge: "replay"`), logging `forged n t` after each round.

All along it rewrites its `status` file (its counters, writer id and pid) every 0.2 s, and at
the end closes the tier and writes `done` to its log. Options for a test: `lease_ttl` (the
lease's `LEASE_TTL`), `secret` (hex: the tier's `auth.secret`), `clock_skew` (seconds added to
this process's `time.time`: a host whose clock is off; boto3's signatures, from `datetime`, are
not moved).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

WALL = time.time
"""The test host's clock, for the log (`clock_skew` moves `time.time` of this process)."""


def main(spec: dict[str, Any]) -> None:
    if spec.get("lease_ttl"):
        import tiers.s3.lease
        import tiers.s3.sweeper

        tiers.s3.lease.LEASE_TTL = spec["lease_ttl"]
        tiers.s3.sweeper.LEASE_TTL = spec["lease_ttl"]
    if spec.get("clock_skew"):
        skew = float(spec["clock_skew"])
        time.time = lambda: WALL() + skew
    if spec["mode"] == "forge":
        forge(spec)
    else:
        asyncio.run(run(spec))


def forge(spec: dict[str, Any]) -> None:
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=spec["endpoint"],
        aws_access_key_id=spec["access_key"],
        aws_secret_access_key=spec["secret_key"],
        region_name="us-east-1",
    )
    bucket, lease = spec["bucket"], spec["prefix"] + "kvtier-lease"
    log = open(spec["log"], "a", buffering=1)  # noqa: SIM115 - lives as long as the worker
    print("ready", WALL(), file=log)
    first: dict[str, bytes] = {}
    end = time.monotonic() + spec.get("linger", 10.0)
    n = 0
    while time.monotonic() < end:
        listed = client.list_objects_v2(Bucket=bucket, Prefix=lease).get("Contents", [])
        names = {lease} | {o["Key"] for o in listed if "-probe-" not in o["Key"]}
        for name in sorted(names):
            if spec["forge"] == "replay":
                if name not in first:
                    try:
                        first[name] = client.get_object(Bucket=bucket, Key=name)["Body"].read()
                    except client.exceptions.NoSuchKey:
                        continue
                body = first[name]
            else:
                line = {"holder": os.urandom(16).hex(), "n": n, "nonce": os.urandom(8).hex()}
                body = json.dumps(line).encode() + b"\n" + os.urandom(32).hex().encode()
            client.put_object(Bucket=bucket, Key=name, Body=body)
        n += 1
        print("forged", n, WALL(), file=log)
        time.sleep(spec.get("interval", 1.0))
    print("done", WALL(), file=log)


async def run(spec: dict[str, Any]) -> None:
    from tiering.testing import NAMESPACE, key, payload
    from tiers.s3 import S3Tier

    log = open(spec["log"], "a", buffering=1)  # noqa: SIM115 - lives as long as the worker
    tier = S3Tier(
        namespace=NAMESPACE,
        bucket=spec["bucket"],
        prefix=spec["prefix"],
        endpoint_url=spec["endpoint"],
        access_key=spec["access_key"],
        secret_key=spec["secret_key"],
        secret=bytes.fromhex(spec["secret"]) if spec.get("secret") else None,
        **spec.get("options", {}),
    )
    status = Path(spec["status"])

    def report() -> None:
        state = {"pid": os.getpid(), "writer": tier.writer.hex(), "counters": dict(tier.counters)}
        status.with_suffix(".tmp").write_text(json.dumps(state))
        status.with_suffix(".tmp").replace(status)

    async def reporting() -> None:
        while True:
            report()
            await asyncio.sleep(0.2)

    reporter = asyncio.ensure_future(reporting())
    await tier.contains([key(10**6)])
    print("ready", WALL(), file=log)
    go = Path(spec["go"])
    while not go.exists():
        await asyncio.sleep(0.01)
    start, stop = spec["keys"]
    size = spec.get("size", 4096)
    if spec["mode"] == "write":
        for i in range(start, stop):
            await tier.put(key(i), payload(size, i))
            print("put", i, WALL(), file=log)
            await asyncio.sleep(spec.get("interval", 0.0))
        await asyncio.sleep(spec.get("linger", 0.0))
    elif spec["mode"] == "read":
        out = bytearray(size)
        for _ in range(spec.get("rounds", 1)):
            for i in range(start, stop):
                if await tier.get(key(i), out) and bytes(out) == payload(size, i):
                    print("got", i, WALL(), file=log)
            await asyncio.sleep(spec.get("interval", 0.0))
        await asyncio.sleep(spec.get("linger", 0.0))
    else:
        missing = set(range(start, stop))
        deadline = time.monotonic() + spec.get("linger", 30.0)
        while missing and time.monotonic() < deadline:
            order = sorted(missing)
            found = await tier.contains([key(i) for i in order])
            now = WALL()
            for i, there in zip(order, found, strict=True):
                if there:
                    print("seen", i, now, file=log)
                    missing.discard(i)
            await asyncio.sleep(spec.get("poll", 0.02))
    reporter.cancel()
    await tier.close()
    report()
    print("done", WALL(), file=log)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
