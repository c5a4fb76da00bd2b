"""`kvtier rekey`: the blocks stored under a previous secret (`auth.previous`) rewritten under
the current one (`auth.secret`), in the main thread's event loop.

A secret picks a store's names (`tiering.keys.store_namespace`) and seals its objects, so each
namespace of the store that a previous secret owns (`owns_namespace`: its label is that
secret's) moves to the same layout's names under the current secret: every block read and
verified under the old secret, written sealed under the current one, read back and compared,
and only then removed from the old names (unless `keep`). Each namespace's move is a
`kvtier.operations.migrate` with its journal, so a rekey killed at any moment resumes
(`resume`) without copying a finished block again and without losing one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.operations import PLACEHOLDER, MigrationSummary, default_journal, migrate
from tiering.config import AuthConfig, Config, TierConfig, tier_from_config
from tiering.errors import ConfigError
from tiering.keys import owns_namespace, store_namespace

__all__ = ["Rekeyed", "rekey", "rekey_plan"]


@dataclass
class Rekeyed:
    """One namespace moved from a previous secret's names to the current one's."""

    source: bytes
    destination: bytes
    journal: Path
    summary: MigrationSummary = field(default_factory=MigrationSummary)


def rekey_plan(config: Config, found: list[bytes]) -> list[tuple[bytes, bytes, bytes]]:
    """(previous secret, its store namespace, the current secret's) for each namespace of
    `found` (a store's listing) that a previous secret owns."""
    current = config.auth.secret
    if current is None or not config.auth.previous:
        raise ConfigError("rekey: needs auth.secret and the secrets it replaces in auth.previous")
    return [
        (old, ns, store_namespace(ns, current))
        for old in config.auth.previous
        for ns in found
        if owns_namespace(ns, old)
    ]


async def rekey(
    config: Config,
    cfg: TierConfig,
    config_path: Path,
    *,
    namespace: bytes | None = None,
    keep: bool = False,
    dry_run: bool = False,
    resume: bool = False,
    concurrency: int = 8,
    progress: Callable[[int], None] | None = None,
) -> list[Rekeyed]:
    """Move every block of `cfg`'s store under a previous secret to the current secret's names
    (`namespace`: only that one, a layout's or a previous secret's store namespace)."""
    async with tier_from_config(cfg, PLACEHOLDER, config, read_only=True) as probe:
        found = await probe.namespaces()
    plan = rekey_plan(config, found)
    if namespace is not None:
        plan = [
            (old, ns, new)
            for old, ns, new in plan
            if namespace in (ns, new) or store_namespace(namespace, old) == ns
        ]
    done: list[Rekeyed] = []
    for old, ns, new in plan:
        before = dataclasses.replace(config, auth=AuthConfig(secret=old))
        journal = default_journal(config_path, f"{cfg.name}@{ns.hex()}", cfg.name, new)
        moved = Rekeyed(ns, new, journal)
        async with (
            tier_from_config(cfg, ns, before, read_only=keep or dry_run) as source,
            tier_from_config(cfg, new, config, read_only=dry_run) as destination,
        ):
            moved.summary = await migrate(
                source,
                destination,
                move=not keep,
                dry_run=dry_run,
                verify_copies=True,
                journal=journal,
                resume=resume,
                concurrency=concurrency,
                progress=progress,
                renamed=True,
            )
        done.append(moved)
    return done
