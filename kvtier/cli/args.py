"""Argument types for the `kvtier` commands: each checks its value and range at parse time, so a
bad argument is argparse's one-line usage error (exit 2) before any work starts."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from tiering.errors import ConfigError
from tiering.units import parse_size

__all__ = ["count", "path", "rate", "sizes"]


def count(low: int = 1, high: int = 1_000_000) -> Callable[[str], int]:
    """An integer from `low` to `high`, in ASCII digits (`int` takes any script's)."""

    def read(text: str) -> int:
        try:
            value = int(text.replace("_", "")) if len(text) <= 20 and text.isascii() else None
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"expected an integer from {low:,} to {high:,}, got {text!r}"
            )
        return value

    return read


def rate(high: float) -> Callable[[str], float]:
    """A finite number above 0 and at most `high`, in ASCII (`float` takes any script's)."""

    def read(text: str) -> float:
        try:
            value = float(text) if len(text) <= 32 and text.isascii() else None
        except ValueError:
            value = None
        if value is None or not 0 < value <= high:
            raise argparse.ArgumentTypeError(
                f"expected a number above 0, at most {high:g}, got {text!r}"
            )
        return value

    return read


def path(text: str) -> Path:
    """A file system path (not empty, no NUL: the system calls cannot take those)."""
    if not text or "\0" in text:
        raise argparse.ArgumentTypeError(f"expected a path, got {text!r}")
    return Path(text)


def sizes(high: int) -> Callable[[str], str]:
    """Comma-separated sizes like `64KiB,2MiB`, each at most `high` bytes; the text is kept
    (the command splits it)."""

    def read(text: str) -> str:
        parts = text.split(",")
        for part in parts:
            try:
                size = parse_size(part, "size")
            except ConfigError as e:
                raise argparse.ArgumentTypeError(str(e).removeprefix("size: ")) from None
            if size > high:
                raise argparse.ArgumentTypeError(
                    f"{part!r} is larger than a block may be ({high >> 20:,} MiB)"
                )
        return text

    return read
