"""The compiled store path of `tiering.primary.PrimaryPool` (`_pool.c`)."""

from collections.abc import Iterable
from typing import Any

def prepare_store(
    ref: dict[Any, int],
    busy: set[Any],
    writing: set[Any],
    free: list[int],
    policy: Any,
    keys: Iterable[Any],
) -> (
    tuple[tuple[Any, ...], tuple[int, ...], tuple[Any, ...], tuple[int, ...]] | tuple[()] | None
): ...
def complete_store(
    ref: dict[Any, int], busy: set[Any], writing: set[Any], keys: Iterable[Any], ok: bool
) -> tuple[Any, ...] | list[Any]: ...
