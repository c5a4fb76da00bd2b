"""The data plane's compiled helpers, loaded with ctypes (built by setup.py as ordinary
extensions; a foreign call releases the GIL for as long as it runs)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

from tiering.compiled import load_extension, missing

__all__ = ["load_function"]


def load_function(
    module: str, name: str, argtypes: Sequence[Any], restype: Any, without: str
) -> Any:
    """Function `name` of the compiled helper `module`, typed; or None, with a warning that
    says what runs `without` it (kvtier installed where no C compiler was)."""
    helper = load_extension(module, f"helper {module}", without)
    if helper is None:
        return None
    try:
        function = getattr(ctypes.CDLL(helper.__file__), name)
    except (OSError, AttributeError) as e:
        missing(f"helper {module}", e, without)
        return None
    function.argtypes = list(argtypes)
    function.restype = restype
    return function
