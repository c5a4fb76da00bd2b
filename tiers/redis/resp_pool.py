"""The Redis tier's pool of fast-path connections to one server (`tiers.redis.resp`), on the
runtime's event loop thread: opened on demand, with their handshake under a deadline, and kept
while they are healthy."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tiers.redis.resp import RCVBUF, RespConnection
from tiers.redis.resp_commands import HandshakeError, RespError, command

__all__ = ["RespPool"]

T = TypeVar("T")


class RespPool:
    """Up to `size` connections to one server, on the runtime's event loop thread (one event
    loop at a time); opened on demand and kept while they are healthy."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        size: int,
        username: str | None = None,
        password: str | None = None,
        db: int = 0,
        connect_timeout: float = 1.0,
    ) -> None:
        self.host, self.port, self.size = host, port, size
        self._hello: list[bytes] = []
        if password is not None:
            auth = ("AUTH", username, password) if username else ("AUTH", password)
            self._hello.append(command(*auth))
        if db:
            self._hello.append(command("SELECT", db))
        self.connect_timeout = connect_timeout
        self._idle: list[RespConnection] = []
        self._gates: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}

    def _gate(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        gate = self._gates.get(loop)
        if gate is None:
            self._gates = {loop: asyncio.Semaphore(self.size)}  # a new loop: forget the old
            gate = self._gates[loop]
        return gate

    async def run(self, exchange: Callable[[RespConnection], Awaitable[T]]) -> T:
        """`exchange` on a pooled connection; once more on a new one if a reused connection
        turns out closed by the server (idle timeout, restart): for idempotent exchanges. A
        connection whose exchange did not finish is closed (its reply stream is out of step)."""
        gate = self._gate()
        await gate.acquire()
        try:
            conn = self._idle.pop() if self._idle else await self._connect()
            conn.uses += 1
            try:
                result = await exchange(conn)
            except (ConnectionError, OSError):
                conn.close()
                if conn.uses == 1:
                    raise
                conn = await self._connect()
                conn.uses += 1
                try:
                    result = await exchange(conn)
                except BaseException:
                    conn.close()
                    raise
            except BaseException:
                conn.close()
                raise
            if conn.broken:
                conn.close()
            else:
                self._idle.append(conn)
            return result
        finally:
            gate.release()

    async def _connect(self) -> RespConnection:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        conn: RespConnection | None = None
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
            if family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # the handshake too: a server that accepts and never answers AUTH must not hang us
            async with asyncio.timeout(self.connect_timeout):
                await loop.sock_connect(sock, address)
                conn = RespConnection(sock)
                for hello in self._hello:
                    await conn.send([hello])
                    try:
                        await conn.reply()
                    except RespError as e:
                        raise HandshakeError(str(e)) from None
        except TimeoutError:
            self._discard(sock, conn)
            raise ConnectionError(
                f"no connection to {self.host}:{self.port} within {self.connect_timeout:g}s"
            ) from None
        except BaseException:
            self._discard(sock, conn)
            raise
        return conn

    @staticmethod
    def _discard(sock: socket.socket, conn: RespConnection | None) -> None:
        if conn is not None:
            conn.close()  # its reader is registered: a bare sock.close() would leave it behind
        else:
            sock.close()

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
