"""kvtier's compiled extensions, loaded where they were built (`setup.py` builds each as an
ordinary extension; `pip install` without a C compiler skips them): each but ARC has a Python
fallback, which runs slower, with one warning that says so; without ARC's, `arc` is refused
with one line (`tiering.policies.arc`)."""

from __future__ import annotations

import importlib
import logging
from typing import Any

__all__ = ["load_extension", "missing"]

log = logging.getLogger(__name__)


def load_extension(module: str, what: str, without: str, attribute: str | None = None) -> Any:
    """The compiled module `module` (or its `attribute`); None, with a warning naming `what`
    is missing and saying what runs `without` it."""
    try:
        loaded = importlib.import_module(module)
        return loaded if attribute is None else getattr(loaded, attribute)
    except (ImportError, AttributeError) as e:
        missing(what, e, without)
        return None


def missing(what: str, error: BaseException, without: str) -> None:
    """Warn that the compiled `what` could not be loaded (`error`), and what runs instead."""
    log.warning(
        "kvtier's compiled %s is missing (%s): %s (reinstall kvtier with a C compiler present)",
        what,
        error,
        without,
    )
