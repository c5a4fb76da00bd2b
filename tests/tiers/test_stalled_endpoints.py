"""A store that stops answering, on S3 and Redis: an endpoint the test starts on 127.0.0.1
accepts and never answers (`silent`), answers a byte every 0.5 s for ever (`trickle`: no
per-read timeout catches it), or answers a few bytes and stalls (`stall`). Every call is a
timeout, every close and every CLI command ends in bounded time."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers.endpoints import MODES, misbehaving
from tiering.testing import NAMESPACE, key
from tiering.tier import Tier

MEDIA = [pytest.param("s3", marks=pytest.mark.s3), pytest.param("redis", marks=pytest.mark.redis)]
_S3_QUICK = {"read_timeout": 1.0, "connect_timeout": 1.0, "retries": 1}
"""Botocore's own timeouts short, so that a silent endpoint is noticed by them in moments: the
test is about what they cannot catch (a trickle) and about close."""


def _tier(medium: str, address: str) -> Tier:
    if medium == "s3":
        from tiers.s3 import S3Tier

        return S3Tier(
            namespace=NAMESPACE,
            bucket="b",
            endpoint_url=f"http://{address}",
            access_key="a",
            secret_key="b",
            timeout=2.0,
            concurrency=2,
            **_S3_QUICK,
        )
    from tiers.redis import RedisTier

    return RedisTier(namespace=NAMESPACE, url=f"redis://{address}/0", timeout=2.0)


def _ends_within(seconds: float, body: object) -> float:
    """Run the coroutine `body` on a loop of its own in a daemon thread: the seconds it took,
    failing the test past `seconds` (a close that blocks its loop cannot be cancelled, so the
    bound is the thread's join, and a hang is left behind, not waited on)."""
    done: list[float] = []

    def run() -> None:
        start = time.monotonic()
        asyncio.run(body)  # type: ignore[arg-type]
        done.append(time.monotonic() - start)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert done, f"still running after {seconds}s"
    return done[0]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("medium", MEDIA)
def test_calls_end_at_their_deadline_and_close_ends_at_once(medium: str, mode: str) -> None:
    """Five primitives at once are each `TierTimeout` (or another TierError) at about their
    2 s deadline, and `close()` then ends within 3 s. Before, an S3 tier's close waited on the
    threads blocked in the trickle for good (still blocked after 30 s)."""
    from tiering.errors import TierError

    closing: list[float] = []

    async def body(address: str) -> None:
        tier = _tier(medium, address)
        calls = [
            tier.contains([key(1)]),
            tier.get_bytes(key(1), 4096),
            tier.put(key(2), b"x" * 4096),
            tier.stat(),
            tier.namespaces(),
        ]
        start = time.monotonic()
        answers = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(a, TierError) for a in answers), answers
        assert time.monotonic() - start < 5
        start = time.monotonic()
        await tier.close()
        closing.append(time.monotonic() - start)

    with misbehaving(mode, "http" if medium == "s3" else "resp") as address:
        _ends_within(40, body(address))
    assert closing[0] < 3, closing


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("medium", MEDIA)
def test_every_cli_command_ends_in_bounded_time(medium: str, mode: str, tmp_path: Path) -> None:
    """`stats`, `ls`, `inspect`, `verify` and `purge` against the endpoint, all at once: each
    exits 1 with one line within 15 s. Before, `kvtier stats` on S3 ran past 60 s (a listing
    page in the trickle for good)."""
    with misbehaving(mode, "http" if medium == "s3" else "resp") as address:
        if medium == "s3":
            quick = ", ".join(f"{k}: {v}" for k, v in _S3_QUICK.items())
            tier = (
                f"{{name: t, type: s3, bucket: b, endpoint_url: 'http://{address}', "
                f"access_key: a, secret_key: b, {quick}}}"
            )
        else:
            tier = f"{{name: t, type: redis, url: 'redis://{address}/0'}}"
        config = tmp_path / "c.yaml"
        config.write_text(f"version: 1\ntiers:\n  - {tier}\n")
        namespace = NAMESPACE.hex()
        commands = {
            "stats": ["stats"],
            "ls": ["ls", "--tier", "t"],
            "inspect": ["inspect", "--tier", "t", key(1).hex()],
            "verify": ["verify", "--tier", "t", "--namespace", namespace],
            "purge": ["purge", "--tier", "t", "--namespace", namespace, "--yes"],
        }
        start = time.monotonic()
        running = {
            name: subprocess.Popen(
                [sys.executable, "-m", "kvtier", args[0], "--config", str(config), *args[1:]],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for name, args in commands.items()
        }
        try:
            for name, process in running.items():
                try:
                    _, err = process.communicate(timeout=max(0.1, start + 15 - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pytest.fail(f"kvtier {name} still running after 15 s")
                assert process.returncode == 1, (name, err)
                assert "Traceback" not in err and f"kvtier {name}: error: " in err, (name, err)
        finally:
            for process in running.values():
                if process.poll() is None:
                    process.kill()
                process.communicate(timeout=10)  # and its pipes closed


@pytest.mark.s3
@pytest.mark.parametrize("mode", MODES)
def test_an_s3_tier_with_a_pack_waiting_closes_within_one_deadline(mode: str) -> None:
    """A block held for a pack and a sweeper (a capacity) at close: the pack's write ends at
    its call's deadline (2 s with these settings), the block is counted lost, and close ends
    within 4 s. Before, the trickle held the close for good."""
    from tiers.s3 import S3Tier

    closing: list[float] = []

    async def body(address: str) -> None:
        tier = S3Tier(
            namespace=NAMESPACE,
            bucket="b",
            endpoint_url=f"http://{address}",
            access_key="a",
            secret_key="b",
            timeout=2.0,
            concurrency=2,
            blocks_per_object=4,
            capacity=1 << 20,
            **_S3_QUICK,
        )
        await tier.put(key(1), b"x" * 4096)  # held for a pack: the put returns at once
        start = time.monotonic()
        await tier.close()
        closing.append(time.monotonic() - start)
        assert tier.counters["blocks_lost"] == 1

    with misbehaving(mode, "http") as address:
        _ends_within(40, body(address))
    assert closing[0] < 4, closing
