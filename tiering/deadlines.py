"""Deadlines of tier calls: a timeout becomes our own `TierTimeout`, named for the tier, in one
place (the event loop thread that owns the tier)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from tiering.errors import TierError, TierTimeout

__all__ = ["within"]

T = TypeVar("T")


async def within(operation: Awaitable[T], timeout: float | None, tier: str) -> T:
    """`operation`'s result, `TierTimeout` past `timeout` seconds (None: no deadline). A
    `TierTimeout` the operation raised itself passes as it is; `tier` names the tier in the
    message."""
    try:
        if timeout is None:
            return await operation
        async with asyncio.timeout(timeout):
            return await operation
    except TimeoutError as e:
        if isinstance(e, TierError):
            raise
        raise TierTimeout(f"tier {tier!r}: no answer within {timeout:g}s") from e
