"""A tier's records: small named objects beside its blocks, in the same store (any thread: pure
functions of a name).

A record is what an engine keeps in a tier about its blocks rather than a block: its warm-start
manifest (`tiering.manager.manifest`). It lives where the tier's blocks do, so the next engine
finds it wherever that engine runs: a `files` directory's `.kvtier/records/`, a Redis key beside
the blocks' prefix, an S3 object beside the namespaces' folders (each backend's
`_write_record`). It is sealed like a block (`Tier.write_record`: the tier's envelope, its
namespace, checksum and, with a deployment secret, its seal), under a key no block can have:
`record_key` of its name, so a record moved under another name, namespace or secret is refused
like a block would be. Records are never listed as blocks, counted in a tier's objects, evicted
with them or read into a slot; they are listed on their own (`list_records`, by a prefix of
their names: a files directory's listing, a Redis SCAN of the records' prefix, an S3 listing of
it), at most `MAX_LISTED_RECORDS` a call, `RECORD_PAGE` a request.
"""

from __future__ import annotations

import hashlib
import re
from typing import Final

from tiering.errors import KeyFormatError
from tiering.keys import GROUP_BYTES, BlockKey

__all__ = [
    "MAX_LISTED_RECORDS",
    "MAX_RECORD_BYTES",
    "RECORD_NAME",
    "RECORD_PAGE",
    "check_record_name",
    "record_key",
]

RECORD_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}\Z")
"""What a record's name looks like: safe as a file name, a Redis key part and an S3 name."""
MAX_RECORD_BYTES: Final = 64 << 20
"""The largest record a tier reads back (a manifest of a 100 GiB primary of 2 MiB blocks is
about 2 MB)."""
MAX_LISTED_RECORDS: Final = 1000
"""The most record names one listing answers (a store holding more: the first it meets). A
fleet's manifests are one per engine and namespace: a thousand engines of one model."""
RECORD_PAGE: Final = 1000
"""Names asked for per request of a listing (an S3 page, a Redis SCAN's COUNT)."""
_DOMAIN = b"kvtier record v1\x00"
_GROUP = b"\xff" * GROUP_BYTES
"""A KV-group index no engine reaches: no block's key is a record's."""


def check_record_name(name: str) -> str:
    """`name` when it is a record's name (`RECORD_NAME`), else `KeyFormatError`."""
    if not isinstance(name, str) or not RECORD_NAME.match(name):
        raise KeyFormatError(f"record name {name!r}: expected {RECORD_NAME.pattern[:-2]}")
    return name


def record_key(name: str) -> BlockKey:
    """The key a record is sealed under (its envelope's, never a block's)."""
    digest = hashlib.sha256(_DOMAIN + check_record_name(name).encode()).digest()
    return BlockKey(digest + _GROUP)
