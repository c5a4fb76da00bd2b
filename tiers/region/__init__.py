"""The shared primary region: one shared-memory file holding every slot of the CPU primary tier.

`mapping` holds each process's mapping of it (`PrimaryRegion`), `file` the file's layout, header,
name and the removal of stale files, `prefault` the mapping of its pages ahead of the first copies.
"""

from tiers.region.mapping import (
    DEFAULT_DIRECTORY,
    PAGE,
    TOKEN_BYTES,
    PrimaryRegion,
    RegionLayout,
    cleanup_stale,
    region_path,
)

__all__ = [
    "DEFAULT_DIRECTORY",
    "PAGE",
    "TOKEN_BYTES",
    "PrimaryRegion",
    "RegionLayout",
    "cleanup_stale",
    "region_path",
]
