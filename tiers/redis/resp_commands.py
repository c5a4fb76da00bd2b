"""The RESP2 commands the Redis tier's fast path sends, and the errors of the protocol (any
thread: pure functions and exception types)."""

from __future__ import annotations

from collections.abc import Sequence

from tiering.tier import Buffer

__all__ = ["HandshakeError", "ReplyError", "RespError", "command", "set_command"]


class RespError(Exception):
    """The server answered with an error reply, or broke the protocol."""


class ReplyError(RespError):
    """The server answered one command with an error reply (`WRONGTYPE` to a GET of a key that
    holds a list, say): a whole reply, so the stream is still in step and the next reply is the
    next command's. Any other `RespError` leaves the connection's place in the stream unknown."""


class HandshakeError(RespError, ConnectionError):
    """The server refused a new connection's AUTH or SELECT (a wrong password, say): the
    connection is unusable, as if it had not opened."""


def command(*args: bytes | str | int) -> bytes:
    """A small command as one RESP array (keys, numbers: not block values)."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def set_command(
    name: bytes, value_parts: Sequence[Buffer], px: int | None, *, nx: bool = False
) -> list[Buffer]:
    """SET name value [NX] [PX px] (milliseconds), the value given in parts (sent by one
    `sendmsg`, not joined). With `nx` the server answers nil, and writes nothing, when the key
    exists."""
    size = sum(len(p) for p in value_parts)
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (
        3 + nx + (0 if px is None else 2),
        len(name),
        name,
        size,
    )
    tail = b"\r\n" + (b"$2\r\nNX\r\n" if nx else b"")
    if px is not None:
        tail += b"$2\r\nPX\r\n$%d\r\n%d\r\n" % (len(str(px)), px)
    return [head, *value_parts, tail]
