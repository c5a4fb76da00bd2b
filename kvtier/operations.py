"""What operators do to stored blocks: migrate, verify, purge, count. Used by the `kvtier` CLI
(and `kvtier.idle`, which purges idle namespaces).

Every function works on tier objects (any backend) and reads objects as stored, verifying them
the way a read by the manager would, so a corrupt or foreign object is never copied.
"""

from __future__ import annotations

import asyncio
import os
import stat
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

from tiering.errors import ConfigError, CorruptObject, StateError, TierError, TierUnavailable
from tiering.keys import BlockKey
from tiering.tier import ObjectInfo, Tier
from tiering.tier.format import REMOVABLE
from tiering.tier.usage import KeepsUsageMarks

__all__ = [
    "JOURNAL_MAGIC",
    "PLACEHOLDER",
    "MigrationSummary",
    "VerifyReport",
    "journal_header",
    "migrate",
    "open_journal",
    "purge",
    "purge_namespace",
    "read_block",
    "verify",
]

PLACEHOLDER = bytes(16)
"""The namespace a tier is opened in to ask which namespaces it holds (an operator's command
that lists or moves namespaces opens it there, read-only)."""

Progress = Callable[[int], None]


async def read_block(tier: Tier, key: BlockKey) -> bytes | None:
    """The block of `key` in `tier`, verified as the engine's reads verify it (with the tier's
    secret, its MAC too); None when absent. Raises `CorruptObject` (with `.reason`) when the
    stored object fails verification, without reading an object larger than any block may be."""
    blob = await tier.read_object(key)
    if blob is None:
        return None
    return bytes(tier.verified_block(key, blob))


async def selected(
    tier: Tier, older_than: float | None, now: float | None = None
) -> AsyncIterator[ObjectInfo]:
    """The tier's objects, only those written more than `older_than` seconds ago if given."""
    now = time.time() if now is None else now
    async for info in tier.entries():
        if older_than is not None:
            if info.modified is None:
                raise ConfigError(
                    f"--older-than: tier {tier.name!r} ({tier.type_name}) does not record when "
                    "its objects were written"
                )
            if now - info.modified < older_than:
                continue
        yield info


@dataclass
class MigrationSummary:
    planned: int = 0
    copied: int = 0
    skipped: int = 0
    """Already done by an earlier run (`resume`), or already present at the destination."""
    failed: int = 0
    moved: int = 0
    """Deleted from the source after their copy was verified (`move`)."""
    errors: list[str] = field(default_factory=list)


async def migrate(
    source: Tier,
    destination: Tier,
    *,
    move: bool = False,
    older_than: float | None = None,
    dry_run: bool = False,
    verify_copies: bool = False,
    journal: Path | None = None,
    resume: bool = False,
    concurrency: int = 8,
    progress: Progress | None = None,
    renamed: bool = False,
) -> MigrationSummary:
    """Copy (or move) every selected block of `source` to `destination`, `concurrency` at a time.

    - Each block is read and verified at the source, written at the destination (in the
      destination's codec), read back and compared with `verify_copies`, and deleted at the
      source with `move` only once its copy is verified (`move` implies `verify_copies`).
    - `journal` records each finished key as soon as it is finished; with `resume` the keys it
      holds are skipped, so a migration killed (even with SIGKILL) continues where it stopped
      without copying finished blocks again and without losing any. Its first line names the
      migration (`journal_header`); a file that is not this migration's journal is refused
      (`ConfigError`) and left as it was (`open_journal`).
    - `renamed`: the tiers' namespaces may differ (the same layout's store namespaces under two
      secrets: `kvtier.rekey`).
    """
    if source.namespace != destination.namespace and not renamed:
        raise ConfigError("migrate: source and destination tiers must use the same namespace")
    verify_copies = verify_copies or move
    done: set[str] = set()
    if journal is not None:
        done = open_journal(
            journal, journal_header(source, destination), resume=resume, write=not dry_run
        )
    summary = MigrationSummary()
    keys = [info.key async for info in selected(source, older_than)]
    summary.planned = len(keys)
    if dry_run:
        return summary
    try:
        log = open(journal, "a") if journal is not None else None  # noqa: SIM115 - closed below
    except OSError as e:
        raise ConfigError(f"journal {journal}: cannot write: {e.strerror or e}") from e
    gate = asyncio.Semaphore(concurrency)
    finished = 0

    async def one(key: BlockKey) -> None:
        nonlocal finished
        async with gate:
            try:
                if key.hex() in done:
                    summary.skipped += 1
                    return
                block = await read_block(source, key)
                if block is None:
                    summary.skipped += 1  # gone since the listing
                    return
                await destination.put(key, block)
                if verify_copies:
                    back = await destination.get_bytes(key, len(block))
                    if back != block:
                        raise CorruptObject("checksum", f"{key.hex()}: the copy read back differs")
                if move:
                    await source.delete(key)
                    summary.moved += 1
                summary.copied += 1
                if log is not None:
                    log.write(key.hex() + "\n")
                    log.flush()  # in the kernel: survives SIGKILL of this process
            except (TierError, StateError) as e:
                summary.failed += 1
                summary.errors.append(f"{key.hex()}: {e}")
            finally:
                finished += 1
                if progress is not None:
                    progress(finished)

    try:
        await asyncio.gather(*(one(key) for key in keys))
    finally:
        if log is not None:
            log.close()
    return summary


@dataclass
class VerifyReport:
    checked: int = 0
    ok: int = 0
    bad: list[tuple[str, str]] = field(default_factory=list)
    """(key hex, reason) of every corrupt or foreign object."""
    repaired: int = 0
    left: list[tuple[str, str]] = field(default_factory=list)
    """(key hex, reason) of the bad objects a repair left in place: their reason proves no
    damage (`tiering.tier.format.REMOVABLE`), so they may be a neighbour's."""


async def verify(
    tier: Tier,
    repair: bool = False,
    progress: Progress | None = None,
    *,
    delete_unauthenticated: bool = False,
) -> VerifyReport:
    """Read every object of the tier's namespace and check header, namespace, lengths,
    checksum and (with a secret) MAC; with `repair`, delete the objects whose damage is
    provable (`tiering.tier.format.REMOVABLE`: whoever wrote them, no reader can use them).

    An object that fails only this reader's checks is left and listed in `left`, repair or
    not: `auth` (another secret's, or written without one: a deployment beside this one, or
    this one's before a rotation), `namespace`, `version`, `codec` (another model's, a newer
    kvtier's). In a store namespace of the tier's own secret (`Tier.names_owned`), an `auth`
    one is a forgery, which repair deletes (`Tier.removable`); elsewhere
    `delete_unauthenticated` (with `repair`) deletes the `auth` ones too: the operator's
    explicit word that no other secret's reader shares the store. Objects the
    tier's start-up scan found damaged (`Tier.damaged`: a header that fails, a file of the
    wrong size) are reported too; a writable file tier removed them when it opened."""
    report = VerifyReport()
    deletable = REMOVABLE | {"auth"} if delete_unauthenticated else REMOVABLE
    for where, reason, removed in tier.damaged:
        report.checked += 1
        report.bad.append((where, reason))
        report.repaired += removed
    async for info in tier.entries():
        report.checked += 1
        try:
            if await read_block(tier, info.key) is not None:
                report.ok += 1
        except CorruptObject as e:
            reason = getattr(e, "reason", "corrupt")
            report.bad.append((info.key.hex(), reason))
            if repair and (reason in deletable or tier.removable(e)):
                await tier.delete(info.key)
                report.repaired += 1
            else:
                report.left.append((info.key.hex(), reason))
        except TierUnavailable:
            raise  # the tier is down: there is nothing to verify
        except TierError as e:  # this object's read failed (a deadline, an odd reply): go on
            report.bad.append((info.key.hex(), f"error: {e}"))
        if progress is not None:
            progress(report.checked)
    return report


async def purge(
    tier: Tier,
    older_than: float | None = None,
    progress: Progress | None = None,
    keys: list[BlockKey] | None = None,
) -> int:
    """Delete every object of the tier's namespace (written more than `older_than` seconds
    ago, if given), or the `keys` a caller listed so; how many were deleted."""
    if keys is None:
        keys = [info.key async for info in selected(tier, older_than)]
    deleted = 0
    for key in keys:
        deleted += await tier.delete(key)
        if progress is not None:
            progress(deleted)
    return deleted


async def purge_namespace(
    tier: Tier, older_than: float | None = None, keys: list[BlockKey] | None = None
) -> int:
    """`purge` of the tier's whole namespace (or its blocks older than `older_than`; `keys`:
    those, listed by the caller); a purge of all of it drops what the tier keeps of its own
    about the namespace too (the Redis tier's last-write marker: `KeepsUsageMarks`). How many
    blocks were deleted."""
    deleted = await purge(tier, older_than, keys=keys)
    if older_than is None and isinstance(tier, KeepsUsageMarks):
        await tier.drop_usage_marks()
    return deleted


JOURNAL_MAGIC = "# kvtier migration journal v1"


def journal_header(source: Tier, destination: Tier) -> str:
    """The first line of a migration's journal: which tiers, which namespace."""
    line = f"{JOURNAL_MAGIC} {source.name} -> {destination.name} {source.namespace.hex()}"
    if destination.namespace != source.namespace:
        line += f" -> {destination.namespace.hex()}"
    return line


def open_journal(journal: Path, header: str, *, resume: bool, write: bool = True) -> set[str]:
    """The keys (hex) that an earlier run finished, read from `journal` when resuming; with
    `write`, the journal is started afresh (its header alone) unless resuming one.

    Only a kvtier journal of this very migration (first line `header`), an empty file or no
    file is taken: anything else (a directory, a device, someone's file, the journal of
    another migration) is refused with a `ConfigError` and left untouched."""
    try:
        found = journal.stat()
    except FileNotFoundError:
        found = None
    except OSError as e:  # a parent that is a file, a name too long, no permission
        raise ConfigError(f"journal {journal}: {e.strerror or e}") from e
    done: set[str] = set()
    if found is not None:
        if stat.S_ISDIR(found.st_mode):
            raise ConfigError(f"journal {journal}: is a directory; give a file name")
        if not stat.S_ISREG(found.st_mode):
            raise ConfigError(f"journal {journal}: not a regular file")
        if found.st_size:
            try:
                with open(journal, "rb") as f:
                    first = f.readline(len(header.encode()) + 2)
                    rest = f.read() if resume else b""
            except OSError as e:
                raise ConfigError(f"journal {journal}: cannot read: {e.strerror or e}") from e
            line = first.decode("utf-8", "replace").rstrip("\n")
            if not line.startswith(JOURNAL_MAGIC):
                raise ConfigError(
                    f"journal {journal}: not a kvtier migration journal (its first line is not "
                    f"'{JOURNAL_MAGIC} ...'); refusing to overwrite it"
                )
            if line != header:
                raise ConfigError(
                    f"journal {journal}: the journal of another migration "
                    f"({line.removeprefix(JOURNAL_MAGIC).strip()}); this one is "
                    f"{header.removeprefix(JOURNAL_MAGIC).strip()}"
                )
            done = {k.strip() for k in rest.decode("ascii", "replace").splitlines() if k.strip()}
    if write and not (resume and found is not None and found.st_size):
        try:
            journal.parent.mkdir(parents=True, exist_ok=True)
            journal.write_text(header + "\n")
        except OSError as e:
            raise ConfigError(f"journal {journal}: cannot write: {e.strerror or e}") from e
    return done


def default_journal(config: Path, source: str, destination: str, namespace: bytes) -> Path:
    """Where a migration's journal lives unless `--journal` says: the XDG cache directory
    (`$XDG_CACHE_HOME`, when absolute, else `~/.cache`), `kvtier/migrations/`."""
    import hashlib

    digest = hashlib.sha256(
        f"{config.resolve()}|{source}|{destination}|{namespace.hex()}".encode()
    ).hexdigest()[:16]
    cache = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(cache) if os.path.isabs(cache) else Path.home() / ".cache"
    return base / "kvtier" / "migrations" / f"{source}-to-{destination}-{digest}.journal"
