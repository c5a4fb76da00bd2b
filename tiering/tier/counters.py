"""The names of the events every tier counts (`Tier.counters`), defined once: the base counts
them, backends count the ones they own (evictions), metrics and tests read them (any thread:
constants)."""

from __future__ import annotations

from typing import Final

__all__ = [
    "BYTES_READ",
    "BYTES_WRITTEN",
    "DELETES",
    "DUPLICATES",
    "DUPLICATE_BYTES",
    "ERRORS",
    "EVICTIONS",
    "FOREIGN_NAMES",
    "HITS",
    "HITS_OTHER_WRITER",
    "HITS_PREVIOUS_SECRET",
    "MISSES",
    "PUTS",
    "REFUSED_SKIPS",
    "corrupt",
]

HITS: Final = "hits"
"""Verified blocks read."""
MISSES: Final = "misses"
"""Reads that found no block, or refused the object they found."""
PUTS: Final = "puts"
"""Blocks stored (duplicates included)."""
DELETES: Final = "deletes"
"""Deletes that found a block."""
BYTES_READ: Final = "bytes_read"
"""Bytes of the blocks of hits."""
BYTES_WRITTEN: Final = "bytes_written"
"""Bytes of the blocks written (not of duplicates)."""
ERRORS: Final = "errors"
"""Calls the store failed (`TierError`s other than a corrupt object, timeouts included)."""
EVICTIONS: Final = "evictions"
"""Objects a tier that `evicts` removed to stay within its capacity."""
DUPLICATES: Final = "duplicates"
"""Puts the store already held (written once: nothing written)."""
DUPLICATE_BYTES: Final = "duplicate_bytes"
"""Bytes of the blocks of those puts."""
HITS_OTHER_WRITER: Final = "hits_other_writer"
"""Hits on objects another tier instance wrote (another engine, or an earlier run)."""
HITS_PREVIOUS_SECRET: Final = "hits_previous_secret"
"""Hits on blocks found under a previous secret during a rotation (`tiering.tier.rotation`):
counted as hits too."""
REFUSED_SKIPS: Final = "refused_skips"
"""Lookups answered no without reading, the name refused moments ago (`tiering.tier.refusals`):
counted as misses too by `get`."""
FOREIGN_NAMES: Final = "foreign_names"
"""Stored names a listing skipped: no kvtier wrote them."""


def corrupt(reason: str) -> str:
    """The name counting objects refused for `reason` (`tiering.tier.format.REASONS`)."""
    return f"corrupt.{reason}"
