"""An engine's Redis tier in a process of its own, for tests of engines sharing one server at the
same time (tests/tiers/test_redis_fleet.py): `python -m tests.tiers.redis_worker '<json>'`.

Roles (the JSON's `role`):
- `write`: connect, print `{"ready": true}`, wait for a line on stdin (the test's start
  signal, given to every writer once all are ready), then `put_many` the blocks
  `payload(size, i)` of `key(i)` for i in `range(n)` (in reverse with `reverse`), `batch` at a
  time; then one JSON line: the tier's counters, its writer id, when it started and ended
  (`time.monotonic`: one clock for every process of the host), and the errors returned.
- `share`: put the blocks one at a time, `interval` seconds apart, printing `{"i", "t"}` once
  each put has returned; after the last, `linger` seconds, then `{"end": t}` and exit.

A block's bytes depend only on its key, as two engines' blocks of one prefix do.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from tiering.testing import NAMESPACE, key, payload
from tiers.redis import RedisTier


def tier_of(args: dict[str, Any]) -> RedisTier:
    return RedisTier(namespace=NAMESPACE, **args["tier"])


async def write(args: dict[str, Any]) -> None:
    n, size, batch = args["n"], args["size"], args["batch"]
    order = list(range(n))[:: -1 if args.get("reverse") else 1]
    errors: list[str] = []
    async with tier_of(args) as tier:
        await tier.contains([key(0)])  # connected before the start, as a running engine is
        print(json.dumps({"ready": True}), flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        start = time.monotonic()
        for at in range(0, n, batch):
            items = [(key(i), payload(size, i)) for i in order[at : at + batch]]
            errors += [repr(o) for o in await tier.put_many(items) if o is not None]
        end = time.monotonic()
    result = {"counters": dict(tier.counters), "writer": tier.writer.hex()}
    print(json.dumps(result | {"start": start, "end": end, "errors": errors}), flush=True)


async def share(args: dict[str, Any]) -> None:
    async with tier_of(args) as tier:
        for i in range(args["n"]):
            await tier.put(key(i), payload(args["size"], i))
            print(json.dumps({"i": i, "t": time.monotonic()}), flush=True)
            await asyncio.sleep(args["interval"])
        await asyncio.sleep(args["linger"])
    print(json.dumps({"end": time.monotonic(), "writer": tier.writer.hex()}), flush=True)


def main() -> None:
    args = json.loads(sys.argv[1])
    asyncio.run({"write": write, "share": share}[args["role"]](args))


if __name__ == "__main__":
    main()
