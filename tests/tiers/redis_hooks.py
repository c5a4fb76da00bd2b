"""White-box hooks of the Redis tier's conformance tests: a raw redis-py client beside the
tier, the naming of `tiers.redis`, and the server killed for `store_down` (shared by the
plain and TLS test modules)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
import redis

from kvtier.servers import RedisClusterServers, RedisServer
from tiering.keys import BlockKey
from tiering.testing import NAMESPACE
from tiering.testing.tier import StoreDown, TierConformance
from tiering.tier import Tier

__all__ = ["RedisHooks", "cluster_ok", "flush", "name", "plant", "stopped", "stored"]


def flush(port: int, password: str | None = None) -> None:
    client = redis.Redis(host="127.0.0.1", port=port, password=password)
    client.flushall()
    client.close()


def name(k: BlockKey, namespace: bytes = NAMESPACE) -> bytes:
    """The Redis key of block `k` (the naming of `tiers.redis`)."""
    return f"kvtier:{namespace.hex()}:{k.hex()}".encode()


def plant(port: int, k: BlockKey, blob: bytes) -> None:
    """Store object bytes as they are under block `k`'s name, with a raw client."""
    client = redis.Redis(host="127.0.0.1", port=port)
    client.set(name(k), blob)
    client.close()


def stored(port: int, k: BlockKey) -> bytes | None:
    """The value under block `k`'s name, read with a raw client."""
    client = redis.Redis(host="127.0.0.1", port=port)
    value: bytes | None = client.get(name(k))
    client.close()
    return value


@contextlib.contextmanager
def stopped(server: RedisServer | RedisClusterServers) -> Iterator[None]:
    """The server (every node of a cluster) killed, then started again on the same ports,
    empty (a cluster's nodes keep their slots in `nodes.conf`)."""
    nodes = server.nodes if isinstance(server, RedisClusterServers) else [server]
    for node in nodes:
        node.stop()
    try:
        yield
    finally:
        for node in nodes:
            node.start()
        if isinstance(server, RedisClusterServers):
            deadline = time.monotonic() + 30
            while not all(cluster_ok(node.port) for node in nodes):
                assert time.monotonic() < deadline, "the cluster did not come back"
                time.sleep(0.1)


def cluster_ok(port: int) -> bool:
    client = redis.Redis(host="127.0.0.1", port=port)
    try:
        info = client.execute_command("CLUSTER INFO")  # redis-py parses it into a dict
        return bool(info.get("cluster_state") == "ok")
    finally:
        client.close()


class RedisHooks(TierConformance):
    """The white-box hooks: a raw redis-py client on the tier's server, beside the tier, and
    the server killed for `store_down`."""

    raw: redis.Redis | redis.RedisCluster
    server: RedisServer | RedisClusterServers

    @pytest.fixture
    def store_down(self) -> StoreDown:
        return lambda tier: stopped(self.server)

    @contextlib.contextmanager
    def connected(self, server: RedisServer | RedisClusterServers) -> Iterator[None]:
        self.server = server
        if isinstance(server, RedisClusterServers):
            self.raw = redis.RedisCluster(host="127.0.0.1", port=server.nodes[0].port)
        else:
            self.raw = redis.Redis(host="127.0.0.1", port=server.port, password=server.password)
        try:
            yield
        finally:
            self.raw.close()

    async def raw_put(self, tier: Tier, key: BlockKey, blob: bytes) -> None:
        self.raw.set(name(key, tier.namespace), blob)

    async def raw_get(self, tier: Tier, key: BlockKey) -> bytes | None:
        value: bytes | None = self.raw.get(name(key, tier.namespace))
        return value
