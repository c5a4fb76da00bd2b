"""An engine resuming a namespace, in a process of its own, for tests of operators' commands
beside live writers (tests/kvtier/test_purge_live.py): `python -m tests.helpers.live_writer`.

Its first line of standard input is JSON (standard input, not the command line: the tier's
entry may hold credentials): `entry` (a tier's YAML entry), `namespace` (hex), `first`, `ready`
and `size`. It writes blocks `first` .. `first + ready - 1` (`payload(size, i)` of key `i`),
prints `{"ready": n}`, then goes on writing one block at a time, printing `{"i": i}` once each
put has returned, until a second line arrives on standard input; then `{"end": n}` and it exits.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from tiering.config import parse_config, tier_from_config
from tiering.keys import BlockKey, make_key
from tiering.testing import payload


def block_key(i: int) -> BlockKey:
    """The key of block `i`, as the tests that read the writer's blocks back make it."""
    return make_key(i.to_bytes(32, "big"))


async def run(args: dict[str, Any]) -> None:
    config = parse_config({"tiers": [args["entry"]]})
    namespace = bytes.fromhex(args["namespace"])
    first, ready, size = args["first"], args["ready"], args["size"]
    async with tier_from_config(config.tiers[0], namespace, config) as tier:
        for at in range(first, first + ready, 50):
            blocks = [
                (block_key(i), payload(size, i)) for i in range(at, min(at + 50, first + ready))
            ]
            failed = [o for o in await tier.put_many(blocks) if o is not None]
            if failed:
                raise SystemExit(f"live writer: puts failed: {failed[:3]}")
        print(json.dumps({"ready": ready}), flush=True)
        stop = asyncio.ensure_future(asyncio.to_thread(sys.stdin.readline))
        i = first + ready
        while not stop.done():
            await tier.put(block_key(i), payload(size, i))
            print(json.dumps({"i": i}), flush=True)
            i += 1
            await asyncio.sleep(0.02)
    print(json.dumps({"end": i - first}), flush=True)


def main() -> None:
    asyncio.run(run(json.loads(sys.stdin.readline())))


if __name__ == "__main__":
    main()
