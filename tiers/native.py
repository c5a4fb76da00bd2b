"""The data plane's compiled helpers, loaded with ctypes (built by setup.py as ordinary
extensions; a foreign call releases the GIL for as long as it runs)."""

from __future__ import annotations

import ctypes
import importlib
import logging
from collections.abc import Sequence
from typing import Any

__all__ = ["load_function"]

log = logging.getLogger(__name__)


def load_function(
    module: str, name: str, argtypes: Sequence[Any], restype: Any, without: str
) -> Any:
    """Function `name` of the compiled helper `module`, typed; or None, with a warning that
    says what runs `without` it (kvtier installed where no C compiler was)."""
    try:
        helper = importlib.import_module(module)
        function = getattr(ctypes.CDLL(helper.__file__), name)
    except (ImportError, OSError, AttributeError) as e:
        log.warning(
            "kvtier's compiled helper %s is missing (%s): %s (reinstall kvtier with a C "
            "compiler present)",
            module,
            e,
            without,
        )
        return None
    function.argtypes = list(argtypes)
    function.restype = restype
    return function
