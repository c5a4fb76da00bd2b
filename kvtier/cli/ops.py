"""`kvtier migrate`, `kvtier verify` and `kvtier purge`: the operations of `kvtier.operations`
on the tiers of a config."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from typing import Any

from kvtier.cli import args as argtypes
from kvtier.cli.common import (
    NAMESPACE,
    TIER,
    add_command,
    confirm,
    emit,
    make_tier,
    resolve_namespace,
    tier_config,
)
from kvtier.cli.progress import Progress
from kvtier.operations import default_journal, migrate, purge, verify
from tiering.config import load_config
from tiering.errors import ConfigError
from tiering.units import parse_duration

__all__ = ["add_parsers", "run_migrate", "run_purge", "run_verify"]


def add_parsers(commands: Any) -> None:
    p = add_command(
        commands, "migrate", "copy or move blocks between two tiers", run_migrate, [NAMESPACE]
    )
    p.add_argument(
        "--from",
        dest="source",
        required=True,
        metavar="TIER",
        help="the tier to copy from, by its name in the config",
    )
    p.add_argument(
        "--to",
        dest="destination",
        required=True,
        metavar="TIER",
        help="the tier to copy to, by its name in the config",
    )
    p.add_argument(
        "--move", action="store_true", help="delete each source block once copied and verified"
    )
    p.add_argument("--older-than", metavar="DURATION", help="only blocks written before, e.g. 7d")
    p.add_argument("--dry-run", action="store_true", help="count what would be copied")
    p.add_argument("--verify", action="store_true", help="read every copy back and compare")
    p.add_argument("--resume", action="store_true", help="skip what an earlier run finished")
    p.add_argument(
        "--journal", type=argtypes.path, help="progress journal (default: under ~/.cache/kvtier)"
    )
    p.add_argument(
        "--concurrency",
        type=argtypes.count(1, 1024),
        default=8,
        help="blocks copied at a time (default 8)",
    )
    p = add_command(
        commands,
        "verify",
        "check every stored block's header and checksum",
        run_verify,
        [TIER, NAMESPACE],
    )
    p.add_argument("--repair", action="store_true", help="delete corrupt and foreign objects")
    p = add_command(
        commands,
        "purge",
        "delete a namespace's blocks, or old ones",
        run_purge,
        [TIER, NAMESPACE],
    )
    p.add_argument("--older-than", metavar="DURATION", help="only blocks written before, e.g. 7d")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")


def run_migrate(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    source_cfg = tier_config(config, args.source)
    destination_cfg = tier_config(config, args.destination)
    if source_cfg.name == destination_cfg.name:
        raise ConfigError("--from and --to name the same tier")
    older = None if args.older_than is None else parse_duration(args.older_than, "--older-than")
    if args.concurrency < 1:
        raise ConfigError(f"--concurrency: must be positive, got {args.concurrency}")

    async def go() -> Any:
        namespace = await resolve_namespace(config, source_cfg, args.namespace)
        journal = args.journal or default_journal(
            args.config, source_cfg.name, destination_cfg.name, namespace
        )
        async with (
            make_tier(config, source_cfg, namespace, read_only=not args.move) as source,
            make_tier(config, destination_cfg, namespace) as destination,
        ):
            bar = Progress(0, f"migrate {source_cfg.name} -> {destination_cfg.name}")
            summary = await migrate(
                source,
                destination,
                move=args.move,
                older_than=older,
                dry_run=args.dry_run,
                verify_copies=args.verify,
                journal=journal,
                resume=args.resume,
                concurrency=args.concurrency,
                progress=bar.update,
            )
            bar.close()
        return summary, journal

    summary, journal = asyncio.run(go())
    data = dataclasses.asdict(summary) | {"journal": str(journal), "dry_run": args.dry_run}
    verb = "would copy" if args.dry_run else "copied"
    lines = [
        f"{verb} {summary.planned if args.dry_run else summary.copied:,} blocks, "
        f"skipped {summary.skipped:,}, failed {summary.failed:,}"
        + (f", moved {summary.moved:,}" if args.move else ""),
        *summary.errors[:10],
    ]
    emit(args, data, lines)
    return 1 if summary.failed else 0


def run_verify(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    cfg = tier_config(config, args.tier)

    async def go() -> Any:
        namespace = await resolve_namespace(config, cfg, args.namespace)
        async with make_tier(config, cfg, namespace, read_only=not args.repair) as tier:
            bar = Progress(0, f"verify {cfg.name}")
            report = await verify(tier, repair=args.repair, progress=bar.update)
            bar.close()
        return report

    report = asyncio.run(go())
    lines = [
        f"checked {report.checked:,} blocks: {report.ok:,} ok, {len(report.bad):,} bad"
        + (f", {report.repaired:,} deleted" if args.repair else "")
    ]
    lines += [f"  {key}: {reason}" for key, reason in report.bad[:50]]
    emit(args, dataclasses.asdict(report), lines)
    return 1 if report.bad and not args.repair else 0


def run_purge(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    cfg = tier_config(config, args.tier)
    if args.namespace is None and args.older_than is None:
        raise ConfigError("purge: give --namespace or --older-than (or both)")
    older = None if args.older_than is None else parse_duration(args.older_than, "--older-than")

    async def go() -> int:
        namespace = await resolve_namespace(config, cfg, args.namespace)
        if not args.yes:
            what = f"blocks older than {args.older_than}" if older else "all blocks"
            if not confirm(
                f"delete {what} of namespace {namespace.hex()} in tier {cfg.name!r}? [y/N] "
            ):
                return -1
        async with make_tier(config, cfg, namespace) as tier:
            return await purge(tier, older)

    deleted = asyncio.run(go())
    if deleted < 0:
        print("kvtier purge: nothing deleted", file=sys.stderr)
        return 1
    return emit(args, {"deleted": deleted}, [f"deleted {deleted:,} blocks"])
