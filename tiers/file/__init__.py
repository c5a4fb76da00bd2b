"""The file tier: blocks on a local (NVMe) file system, in one of two layouts.

- `files` (`BlockFileTier`, `tiers.file.files`): a file per block, written to a temporary file
  and given its name once; any number of processes may share a directory, each finding what
  the others write, within one capacity (`tiers.file.shared`).
- `segments` (`SegmentFileTier`, `tiers.file.segments`): blocks appended to large segment
  files, one system call per block, kernel AIO from the event loop where the disk allows; one
  writer per directory.

Both are `FileTier`s (`tiers.file.base`: the directory, O_DIRECT, the free-space guard, the
pool); `FileTier.variant(options)` is the class the `layout` option names.
"""

from tiers.file.base import LAYOUTS, FileOptions, FileTier
from tiers.file.files import BlockFileTier, FilesOptions
from tiers.file.segments import SegmentFileTier, SegmentOptions

__all__ = [
    "LAYOUTS",
    "BlockFileTier",
    "FileOptions",
    "FileTier",
    "FilesOptions",
    "SegmentFileTier",
    "SegmentOptions",
]
