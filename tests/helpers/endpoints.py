"""A TCP endpoint that misbehaves on purpose, on 127.0.0.1, for the tests of what a tier does
when its store stops answering (test process: one thread accepts, one per connection serves).

- `silent`: accepts, reads what it is sent, never answers.
- `trickle`: accepts and answers one byte every `interval` seconds, for ever: an answer that
  never ends, which no per-read timeout catches (each read gets its byte in time).
- `stall`: accepts, answers the first bytes of a plausible answer, then nothing.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["MODES", "misbehaving"]

MODES = ("silent", "trickle", "stall")

_ANSWERS = {
    "http": b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\nX-Trickle: ",
    "resp": b"$1000000\r\n",
}


@contextmanager
def misbehaving(mode: str, protocol: str, interval: float = 0.5) -> Iterator[str]:
    """`host:port` of an endpoint misbehaving as `mode` says, speaking the first bytes of
    `protocol` (`http` or `resp`) where it answers at all; closed, with every connection, on
    exit."""
    assert mode in MODES and protocol in _ANSWERS
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()
    connections: list[socket.socket] = []

    def serve(conn: socket.socket) -> None:
        try:
            conn.settimeout(interval)
        except OSError:  # closed at the end before this thread ran
            return
        answer = _ANSWERS[protocol]
        sent = 0
        while not stop.is_set():
            try:
                if not conn.recv(1 << 16):
                    return  # the client went
            except TimeoutError:
                pass
            except OSError:
                return
            try:
                if mode == "trickle":
                    conn.sendall(answer[sent : sent + 1] if sent < len(answer) else b"a")
                    sent += 1
                elif mode == "stall" and sent == 0:
                    conn.sendall(answer[:8])
                    sent = 8
            except OSError:
                return

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            connections.append(conn)
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        acceptor.join(timeout=5)
        listener.close()
        for conn in connections:
            conn.close()
        time.sleep(0)
