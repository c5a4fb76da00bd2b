"""A minimal RESP2 client for the Redis tier's hot path: GET straight into a primary slot and
SET from one without joining header and payload, on the runtime's event loop (non-blocking
sockets, no threads, no intermediate copies of a block).

This module is the connection and its reply parser; the pool of connections is
`tiers.redis.resp_pool`, the commands and the protocol's errors `tiers.redis.resp_commands`. It
speaks to one plain-TCP server and only the commands the tier's data path needs (GET, SET,
AUTH, SELECT, PING); redis-py stays for everything else (EXISTS, DEL, SCAN, TLS, Cluster). A
connection whose exchange did not finish (an error, a timeout, a cancellation) is closed, never
reused: its position in the reply stream is unknown.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import socket
from collections.abc import Sequence
from typing import Any

from tiering.errors import CorruptObject
from tiering.tier import Buffer
from tiering.tier.format import peek_lengths
from tiers.native import load_function
from tiers.redis.resp_commands import HandshakeError, ReplyError, RespError, command, set_command

__all__ = [
    "HandshakeError",
    "ReplyError",
    "RespConnection",
    "RespError",
    "command",
    "set_command",
]

HEADER_PEEK = 512
"""Bytes of a value read before its payload is placed (an object header is ~100 bytes)."""
READ_BUFFER = 1 << 18
RCVBUF = 4 << 20
REPLY_MAX = 1 << 20
"""The largest bulk reply to a command other than GET (AUTH, SELECT, SET answer a few bytes)."""


class _ReadState(ctypes.Structure):
    """`kvtier_resp_state` of tiers/redis/_respread.c: every field 64 bits, addresses as
    integers."""

    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "count",
            "head",
            "payload",
            "payload_len",
            "limit",
            "head_len",
            "head_max",
            "item",
            "phase",
            "at",
            "buf",
            "cap",
            "start",
            "end",
            "err",
        )
    ]


_read_replies = load_function(
    "tiers.redis._respread",
    "kvtier_resp_read",
    [ctypes.c_int, ctypes.POINTER(_ReadState)],
    ctypes.c_int,
    "the Redis tier reads values in Python, several GIL hand-overs per value",
)
_AGAIN, _CLOSED, _PROTOCOL = 1, -1, -2  # kvtier_resp_read's answers (and 0: done, 2: other)


def _address(view: memoryview) -> int:
    return ctypes.addressof((ctypes.c_char * len(view)).from_buffer(view))


def _addresses(values: Sequence[int]) -> Any:
    return (ctypes.c_uint64 * len(values))(*values)


class RespConnection:
    """One connection, on the runtime's event loop thread; used by one coroutine at a time
    (the pool sees to it)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._fd = sock.fileno()  # kept: a closed socket's fileno() is -1, its registration not
        self._buffer = bytearray(READ_BUFFER)
        self._view = memoryview(self._buffer)
        self._buffer_address = _address(self._view)  # for the compiled reader
        self._start = 0
        self._end = 0
        self._reading_on: asyncio.AbstractEventLoop | None = None  # where the reader is
        self._waiter: asyncio.Future[None] | None = None
        self._asked = False  # a request was sent and nothing read since: wait before reading
        self.uses = 0
        self.broken = False
        """The reply stream is out of step (a value was refused unread): close, never reuse."""

    def close(self) -> None:
        """Unregister the reader, then close the socket (in this order: the loop's selector
        keeps a closed fd's entry, and a new socket given the same number would inherit it)."""
        if self._reading_on is not None and not self._reading_on.is_closed():
            self._reading_on.remove_reader(self._fd)
        self._reading_on = None
        self.sock.close()

    # -- sending ----------------------------------------------------------------------------------

    async def send(self, parts: Sequence[Buffer]) -> None:
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        sock = self.sock
        while views:
            try:
                sent = sock.sendmsg(views[:512])  # IOV_MAX is 1024
            except (BlockingIOError, InterruptedError):
                sent = 0
            while views and sent >= len(views[0]):
                sent -= len(views.pop(0))
            if views and sent:
                views[0] = views[0][sent:]
            elif views:
                await self._ready(writing=True)
        self._asked = True

    # -- receiving --------------------------------------------------------------------------------

    async def _ready(self, writing: bool = False) -> None:
        """Wait until the socket can be read (or written). The reader stays registered between
        waits and between exchanges (two `epoll_ctl` calls fewer per reply); it unregisters
        itself when it fires with nobody waiting and bytes or an end to read (a peer that
        closed an idle connection must not spin the loop), not on a stale event."""
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        if writing:
            fd = self.sock.fileno()

            def wake() -> None:
                if not waiter.done():
                    waiter.set_result(None)

            loop.add_writer(fd, wake)
            try:
                await waiter
            finally:
                loop.remove_writer(fd)
            return
        if self._reading_on is not loop:
            loop.add_reader(self._fd, self._readable)
            self._reading_on = loop
        self._waiter = waiter
        try:
            await waiter
        finally:
            self._waiter = None

    def _readable(self) -> None:
        waiter = self._waiter
        if waiter is None:
            try:
                self.sock.recv(1, socket.MSG_PEEK)
            except (BlockingIOError, InterruptedError):
                return  # a stale event (the bytes were read meanwhile): stay registered
            except OSError:
                pass
            assert self._reading_on is not None
            self._reading_on.remove_reader(self._fd)
            self._reading_on = None
        elif not waiter.done():
            waiter.set_result(None)

    async def _fill(self) -> None:
        """Read what the socket has into the buffer (at least one byte)."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buffer):  # keep the unread bytes, at the front
            left = self._end - self._start
            self._view[:left] = self._view[self._start : self._end]
            self._start, self._end = 0, left
        if self._asked:  # the reply is on its way, hardly here yet: a recv now would be wasted
            self._asked = False
            await self._ready()
        while True:
            try:
                got = self.sock.recv_into(self._view[self._end :])
            except (BlockingIOError, InterruptedError):
                await self._ready()
                continue
            if got == 0:
                raise ConnectionError("the server closed the connection")
            self._end += got
            return

    async def readline(self) -> bytes:
        while True:
            at = self._buffer.find(b"\r\n", self._start, self._end)
            if at >= 0:
                line = bytes(self._view[self._start : at])
                self._start = at + 2
                return line
            if self._end - self._start > 64 << 10:
                raise RespError("a reply line longer than 64 KiB")
            await self._fill()

    async def read_into(self, dest: memoryview) -> None:
        """Exactly `len(dest)` bytes: first what is buffered, then straight from the socket."""
        n = min(self._end - self._start, len(dest))
        dest[:n] = self._view[self._start : self._start + n]
        self._start += n
        done = n
        sock = self.sock
        while done < len(dest):
            if len(dest) - done < 4096:  # a short tail: through the buffer, fewer syscalls
                await self._fill()
                n = min(self._end - self._start, len(dest) - done)
                dest[done : done + n] = self._view[self._start : self._start + n]
                self._start += n
                done += n
                continue
            try:
                got = sock.recv_into(dest[done:])
            except (BlockingIOError, InterruptedError):
                await self._ready()
                continue
            if got == 0:
                raise ConnectionError("the server closed the connection")
            done += got

    async def _crlf(self) -> None:
        end = bytearray(2)
        await self.read_into(memoryview(end))
        if end != b"\r\n":
            raise RespError("a bulk reply does not end with CRLF")

    async def _bulk_length(self) -> int:
        line = await self.readline()
        if line[:1] == b"-":
            raise ReplyError(line[1:].decode(errors="replace"))
        if line[:1] != b"$":
            raise RespError(f"expected a bulk reply, got {line[:40]!r}")
        return int(line[1:])

    async def skip(self, n: int) -> None:
        """Read and drop `n` bytes, through the connection's own buffer (no allocation)."""
        while n:
            if self._start == self._end:
                await self._fill()
            taken = min(n, self._end - self._start)
            self._start += taken
            n -= taken

    async def reply(self) -> bytes | int | None:
        """A simple, integer or small bulk reply; an error reply raises `ReplyError`."""
        line = await self.readline()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b":":
            return int(rest)
        if kind == b"-":
            raise ReplyError(rest.decode(errors="replace"))
        if kind == b"$":
            n = int(rest)
            if n > REPLY_MAX:
                self.broken = True
                raise RespError(f"a reply of {n} bytes to a command that answers a few")
            return await self._bulk(n)
        raise RespError(f"unexpected reply {line[:40]!r}")

    async def value(self, limit: int, drain: int = 0) -> bytes | None:
        """A bulk reply as bytes (None: no such key); one longer than `limit` bytes raises
        `CorruptObject("length")` unread (see `value_into` for `drain`), an error reply (a key that
        holds no string) `ReplyError`."""
        n = await self._bulk_length()
        if n > limit:
            await self._refuse(n, limit, drain)
        return await self._bulk(n)

    async def _refuse(self, n: int, limit: int, drain: int) -> None:
        """Refuse a value of `n` bytes: drop it through the buffer when it is at most `drain`
        bytes (the stream stays in step), else leave the connection `broken`."""
        if n <= drain:
            await self.skip(n)
            await self._crlf()
        else:
            self.broken = True
        raise CorruptObject("length", f"object of {n} bytes, at most {limit} expected")

    async def _bulk(self, n: int) -> bytes | None:
        if n < 0:
            return None
        data = bytearray(n)
        await self.read_into(memoryview(data))
        await self._crlf()
        return bytes(data)

    async def values_into(
        self, payloads: Sequence[memoryview], limits: Sequence[int]
    ) -> list[tuple[bytes, bool]]:
        """`value_into` of the next replies, by the compiled reader (tiers/redis/_respread.c: one
        call per readiness event, the GIL released for it, however many bytes it moves), up to
        the first reply it does not take (nil, an error reply, an object whose size does not
        split into a header and exactly its payload, one over its limit): that one is left
        unread, for `value_into`. Empty without the compiled reader."""
        if _read_replies is None or not payloads or not all(payloads):
            return []
        n = len(payloads)
        heads = [bytearray(HEADER_PEEK) for _ in range(n)]
        head_len = (ctypes.c_uint64 * n)()
        arrays = (  # referenced by address only: kept alive here for the calls
            _addresses([_address(memoryview(h)) for h in heads]),
            _addresses([_address(p) for p in payloads]),
            _addresses([len(p) for p in payloads]),
            _addresses(limits),
        )
        state = _ReadState(
            count=n,
            head=ctypes.addressof(arrays[0]),
            payload=ctypes.addressof(arrays[1]),
            payload_len=ctypes.addressof(arrays[2]),
            limit=ctypes.addressof(arrays[3]),
            head_len=ctypes.addressof(head_len),
            head_max=HEADER_PEEK,
            buf=self._buffer_address,
            cap=len(self._buffer),
            start=self._start,
            end=self._end,
        )
        if self._asked:  # the replies are on their way, hardly here yet
            self._asked = False
            await self._ready()
        while True:
            rc = _read_replies(self._fd, ctypes.byref(state))
            self._start, self._end = int(state.start), int(state.end)
            if rc != _AGAIN:
                break
            await self._ready()
        if rc == _CLOSED:
            raise ConnectionError("the server closed the connection")
        if rc == _PROTOCOL:
            raise RespError("a bulk reply does not end with CRLF")
        if rc < 0:
            raise OSError(int(state.err), os.strerror(int(state.err)))
        out = []
        for i in range(int(state.item)):
            head = bytes(heads[i][: head_len[i]])
            if peek_lengths(head) == (len(head), len(payloads[i])):
                out.append((head, True))
            else:  # not what it says it is: the whole object, for the caller to refuse
                out.append((head + bytes(payloads[i]), False))
        return out

    async def value_into(
        self, payload: memoryview, limit: int, drain: int = 0
    ) -> tuple[bytes, bool] | None:
        """A stored object as `tiering.tier.ReadsInto` answers it: `(header, True)` when its
        payload was read straight into `payload` (the header says the payload is exactly that
        long and the value is exactly header and payload), otherwise `(whole object, False)`
        (the caller's checks refuse it). None: no such key. An error reply raises `ReplyError`.

        An object longer than `limit` bytes raises `CorruptObject("length")` without being read into
        memory: dropped through the connection's buffer when it is at most `drain` bytes (a
        pipeline's later replies stay readable), else the connection is left `broken` (the
        pool closes it: cheaper than reading a value of hundreds of MiB only to drop it)."""
        n = await self._bulk_length()
        if n < 0:
            return None
        if n > limit:
            await self._refuse(n, limit, drain)
        head = bytearray(min(n, HEADER_PEEK))
        await self.read_into(memoryview(head))
        lengths = peek_lengths(memoryview(head))
        if lengths is not None:
            offset, stored = lengths
            if stored == len(payload) and offset + stored == n and offset <= len(head):
                already = len(head) - offset
                payload[:already] = head[offset:]
                await self.read_into(payload[already:])
                await self._crlf()
                return bytes(head[:offset]), True
        rest = bytearray(n - len(head))
        await self.read_into(memoryview(rest))
        await self._crlf()
        return bytes(head + rest), False
