"""An owner caching beside a stranger who keeps forging its names, at the same time (a real
process each; a `files` directory and a real redis-server): whoever lists the store learns the
owner's store namespace and rewrites its 20 blocks' names with objects that carry no MAC, five
times a second. The owner never gets a forged byte, keeps hitting while the stranger writes, and
once the stranger stops, caches and hits every block: no name is unusable for good."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from kvtier.servers import RedisServer
from tiering.keys import store_namespace
from tiering.testing import NAMESPACE, SECRET, key, payload
from tiers.file import BlockFileTier
from tiers.redis import RedisTier

pytestmark = pytest.mark.redis

OWN = store_namespace(NAMESPACE, SECRET)
BLOCKS = 20
SIZE = 4096
ATTACK_SECONDS = 4.0

STRANGER = """
import os, sys, time
from tiering.keys import key_path
from tiering.testing import craft, key, payload
kind, where, ns_hex, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
blocks, size = int(sys.argv[5]), int(sys.argv[6])
align = 4096 if kind == "files" else 1
ns = bytes.fromhex(ns_hex)
if kind == "redis":
    import redis
    client = redis.Redis.from_url(where)
end = time.monotonic() + seconds
rounds = 0
while time.monotonic() < end:
    for i in range(blocks):
        k = key(i)
        forged = craft(k, payload(size, 999), namespace=ns, align=align)
        if kind == "redis":
            client.set(f"kvtier:{ns_hex}:{k.hex()}".encode(), forged)
        else:
            path = os.path.join(where, ns_hex, key_path(k) + ".kv")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + ".forging", "wb") as f:
                f.write(forged)
            os.replace(path + ".forging", path)
    rounds += 1
    time.sleep(0.2)
print(rounds)
"""


def owner(kind: str, where: str) -> Any:
    if kind == "files":
        return BlockFileTier(namespace=OWN, secret=SECRET, path=where, min_free=0)
    return RedisTier(namespace=OWN, secret=SECRET, url=where)


async def cache_round(tier: Any, hits: list[int]) -> None:
    """Each block read, put where it missed and read again; a forged byte fails the test."""
    for i in range(BLOCKS):
        got = await tier.get_bytes(key(i), SIZE)
        if got is None:
            await tier.put(key(i), payload(SIZE, i))
            got = await tier.get_bytes(key(i), SIZE)
        assert got is None or got == payload(SIZE, i), f"block {i}: a forged byte was served"
        hits[i] += got is not None


@pytest.mark.parametrize("kind", ["files", "redis"])
def test_a_stranger_forging_the_owners_names_never_makes_a_key_unusable(
    kind: str, tmp_path: Path, redis_server: RedisServer
) -> None:
    if kind == "redis":
        redis.Redis.from_url(redis_server.url).flushall()
    where = str(tmp_path / "nvme") if kind == "files" else redis_server.url
    os.makedirs(tmp_path / "nvme", exist_ok=True)
    stranger = subprocess.Popen(
        [sys.executable, "-c", STRANGER, kind, where, OWN.hex(), str(ATTACK_SECONDS)]
        + [str(BLOCKS), str(SIZE)],
        stdout=subprocess.PIPE,
        text=True,
    )

    async def body() -> tuple[list[int], list[int], dict[str, int]]:
        during = [0] * BLOCKS
        after = [0] * BLOCKS
        async with owner(kind, where) as tier:
            time.sleep(0.5)  # the stranger's first round is in place
            end = time.monotonic() + ATTACK_SECONDS - 1.0
            while time.monotonic() < end:
                await cache_round(tier, during)
                await asyncio.sleep(0.05)
        out, _ = stranger.communicate(timeout=30)
        assert stranger.returncode == 0
        rounds.append(int(out))
        async with owner(kind, where) as tier:
            await cache_round(tier, [0] * BLOCKS)  # what the stranger left: refused, replaced
            await cache_round(tier, after)
            return during, after, dict(tier.counters)

    rounds: list[int] = []
    try:
        during, after, counters = asyncio.run(body())
    finally:
        stranger.kill()
        stranger.communicate()
    assert rounds[0] >= 5, rounds  # the stranger really wrote throughout
    assert sum(during) > 0, during  # hits while the stranger writes
    assert after == [1] * BLOCKS, (after, counters)
