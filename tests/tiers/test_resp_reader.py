"""The compiled reader of pipelined GET replies (tiers/redis/_respread.c,
`RespConnection.values_into`): byte for byte what the Python reader (`value_into`) answers,
whatever the replies are and however the bytes arrive; the replies it does not take are left
unread for the Python reader.

The replies come from the other end of a socket pair, written by a thread in chunks of random
sizes (one byte to a few hundred KiB) with pauses: every split of a bulk line, a header, a
payload and a CRLF across reads is met. The tier-level behaviour (real redis-server, planted
objects) is in test_redis.py.
"""

from __future__ import annotations

import asyncio
import random
import socket
import threading
import time
from collections.abc import Iterator

import pytest

import tiers.redis.resp as resp
from tiering.keys import make_key
from tiering.testing import payload
from tiering.tier.format import encode
from tiers.redis.resp import RespConnection, RespError

NS = bytes(16)


def obj(i: int, size: int) -> bytes:
    header, body = encode(make_key(i.to_bytes(32, "big")), NS, payload(size, i))
    return header + bytes(body)


def bulk(value: bytes | None) -> bytes:
    return b"$-1\r\n" if value is None else b"$%d\r\n%s\r\n" % (len(value), value)


def feed(sock: socket.socket, data: bytes, seed: int, close: bool = False) -> threading.Thread:
    """Write `data` to `sock` from a thread, in random chunks with short pauses."""

    def run() -> None:
        rng = random.Random(seed)
        at = 0
        while at < len(data):
            n = rng.choice([1, 2, 3, 7, 100, 4096, 65536, 300_000])
            sock.sendall(data[at : at + n])
            at += n
            if rng.random() < 0.2:
                time.sleep(0.001)
        if close:
            sock.shutdown(socket.SHUT_WR)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def pair() -> Iterator[tuple[RespConnection, socket.socket]]:
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    conn = RespConnection(ours)
    yield conn, theirs
    conn.close()
    theirs.close()


async def read_all(
    conn: RespConnection, views: list[memoryview], limit: int, fast: bool
) -> list[object]:
    """Every reply, as `_fetch_pipeline` reads them: the compiled reader's share, then one
    reply the Python way, and so on (only the Python way when not `fast`)."""
    got: list[object] = []
    while len(got) < len(views):
        if fast:
            got.extend(await conn.values_into(views[len(got) :], [limit] * (len(views) - len(got))))
            if len(got) == len(views):
                break
        try:
            got.append(await conn.value_into(views[len(got)], limit, 1 << 20))
        except Exception as e:  # noqa: BLE001 (compared as text)
            got.append(f"{type(e).__name__}: {e}")
    return got


def test_the_compiled_reader_is_built() -> None:
    assert resp._read_replies is not None  # `pip install` builds tiers/redis/_respread.c


@pytest.mark.parametrize("seed", range(8))
def test_every_reply_reads_as_the_python_reader_reads_it(seed: int) -> None:
    """Objects that split into header and payload (most), one of another size, nil, an error
    reply, a value too large for its limit (drained), a payload-only value: the answers, and
    the buffers the answers say were filled, equal the Python reader's, and what follows is
    read in step."""
    rng = random.Random(seed)
    size = rng.choice([4096, 65536, 512 << 10])
    kinds = rng.choices(["object", "object", "object", "nil", "error", "odd", "huge", "raw"], k=24)
    replies = []
    for i, kind in enumerate(kinds):
        if kind == "object":
            replies.append(bulk(obj(i, size)))
        elif kind == "nil":
            replies.append(bulk(None))
        elif kind == "error":
            replies.append(b"-WRONGTYPE Operation against a key holding the wrong kind\r\n")
        elif kind == "odd":
            replies.append(bulk(obj(i, size // 2)))  # a smaller block under the same key
        elif kind == "huge":
            replies.append(bulk(bytes(size + 4096)))  # past the limit: drained
        else:
            replies.append(bulk(payload(size, i)))  # no header at all
    data = b"".join(replies)
    limit = size + 1024
    answers = {}
    for fast in (True, False):
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        conn = RespConnection(ours)
        buffers = [bytearray(size) for _ in kinds]
        thread = feed(theirs, data, seed)
        got = asyncio.run(read_all(conn, [memoryview(b) for b in buffers], limit, fast))
        thread.join()
        # a buffer holds what was read into it only where the answer says so (True)
        placed = [
            bytes(b) if a is not None and not isinstance(a, str) and a[1] else None
            for a, b in zip(got, buffers, strict=True)
        ]  # type: ignore[index]
        answers[fast] = (got, placed)
        conn.close()
        theirs.close()
    assert answers[True] == answers[False]
    got, buffers = answers[True]
    for i, kind in enumerate(kinds):
        if kind == "object":
            assert got[i] is not None and got[i][1] is True  # type: ignore[index]
            assert buffers[i] == payload(size, i)


def test_the_compiled_reader_stops_at_what_it_does_not_take(
    pair: tuple[RespConnection, socket.socket],
) -> None:
    conn, theirs = pair
    size = 4096
    data = bulk(obj(0, size)) + bulk(obj(1, size)) + bulk(None) + bulk(obj(3, size))
    thread = feed(theirs, data, 1)
    views = [memoryview(bytearray(size)) for _ in range(4)]

    async def body() -> None:
        first = await conn.values_into(views, [size + 1024] * 4)
        assert [ok for _, ok in first] == [True, True]  # then nil: the Python reader's
        assert await conn.value_into(views[2], size + 1024) is None
        rest = await conn.values_into(views[3:], [size + 1024])
        assert len(rest) == 1 and bytes(views[3]) == payload(size, 3)

    asyncio.run(body())
    thread.join()


def test_a_reply_without_its_crlf_breaks_the_connection(
    pair: tuple[RespConnection, socket.socket],
) -> None:
    conn, theirs = pair
    size = 4096
    value = obj(0, size)
    thread = feed(theirs, b"$%d\r\n%sXY" % (len(value), value), 2)
    with pytest.raises(RespError, match="does not end with CRLF"):
        asyncio.run(conn.values_into([memoryview(bytearray(size))], [size + 1024]))
    thread.join()


def test_a_server_that_closes_in_the_middle_of_a_reply(
    pair: tuple[RespConnection, socket.socket],
) -> None:
    conn, theirs = pair
    size = 65536
    thread = feed(theirs, bulk(obj(0, size))[:30_000], 3, close=True)
    with pytest.raises(ConnectionError, match="closed the connection"):
        asyncio.run(conn.values_into([memoryview(bytearray(size))], [size + 1024]))
    thread.join()


def test_a_cancelled_read_leaves_nothing_running(
    pair: tuple[RespConnection, socket.socket],
) -> None:
    """The reader never waits inside C: a read cancelled while the server is silent returns
    at once (the pool then closes the connection: its place in the stream is unknown)."""
    conn, theirs = pair
    theirs.sendall(b"$%d\r\n" % (65536 + 200) + bytes(100))  # a header of 200 bytes, then silence

    async def body() -> None:
        began = time.monotonic()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await conn.values_into([memoryview(bytearray(65536))], [1 << 20])
        assert time.monotonic() - began < 0.5

    asyncio.run(body())


def test_without_the_compiled_reader_the_python_reader_reads_everything(
    monkeypatch: pytest.MonkeyPatch, pair: tuple[RespConnection, socket.socket]
) -> None:
    monkeypatch.setattr(resp, "_read_replies", None)
    conn, theirs = pair
    assert asyncio.run(conn.values_into([memoryview(bytearray(4))], [100])) == []


def test_a_missing_helper_is_a_warning_and_none(caplog: pytest.LogCaptureFixture) -> None:
    from tiers.native import load_function

    assert load_function("tiers.nowhere", "f", [], None, "Python does it") is None
    assert "tiers.nowhere is missing" in caplog.text and "Python does it" in caplog.text
