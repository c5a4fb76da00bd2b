"""Reused buffers that encrypted payloads are sealed into (any thread: under a lock).

An encrypted put needs a buffer for its ciphertext. A fresh one per put costs what the
encryption costs again: a 2 MiB allocation is mapped fresh by the allocator, and every page of
it faults and is zeroed by the kernel on first write. The pool keeps the buffers of puts that
have ended and hands them to the next ones, so the AES pass writes into memory that is already
mapped and in cache: it takes the place of the copy a tier makes of a plaintext payload.

A buffer comes back only from a put whose write ended normally (`give_back`); one whose write
failed, timed out or was cancelled may still be read by a backend's thread, so it is not given
back: the garbage collector frees it once nothing holds it, and it is never handed out again.
Lent buffers are of their own type (`Scratch`, page-aligned anonymous memory), so a caller's
block is never taken for one. The pool keeps
at most `KEEP_BYTES` (beyond, buffers given back are dropped): its memory is bounded whatever
the block sizes and the calls in flight.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Sequence
from typing import Final

__all__ = ["KEEP_BYTES", "Scratch", "ScratchPool"]

KEEP_BYTES: Final = 64 << 20
"""The most bytes of idle buffers the pool keeps (32 blocks of 2 MiB: above the calls in
flight of a tier's batch write)."""


class Scratch(mmap.mmap):
    """A buffer the pool lent: anonymous memory, page-aligned, so a file tier writes it with
    O_DIRECT from where it lies as it does a primary slot (its type tells a pooled payload from
    a caller's block)."""


class ScratchPool:
    """Buffers for ciphertexts, by size (any thread)."""

    def __init__(self, keep_bytes: int = KEEP_BYTES) -> None:
        self.keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._free: dict[int, list[Scratch]] = {}
        self._kept = 0

    @property
    def kept(self) -> int:
        """Bytes of idle buffers held now."""
        return self._kept

    def take(self, size: int) -> Scratch:
        """A buffer of exactly `size` bytes (at least 1; its contents are garbage), reused
        when one is idle."""
        with self._lock:
            free = self._free.get(size)
            if free:
                self._kept -= size
                return free.pop()
        return Scratch(-1, size)

    def give_back(self, parts: Sequence[object]) -> None:
        """Keep for reuse the buffers that back `parts` (an object's parts, once its write
        ended normally): those `take` lent; anything else (a caller's block) is left alone."""
        for part in parts:
            buffer = part.obj if isinstance(part, memoryview) else part
            if not isinstance(buffer, Scratch):
                continue
            with self._lock:
                if self._kept + len(buffer) <= self.keep_bytes:
                    self._free.setdefault(len(buffer), []).append(buffer)
                    self._kept += len(buffer)
