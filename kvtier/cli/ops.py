"""`kvtier migrate`, `kvtier verify` and `kvtier purge`: the operations of `kvtier.operations`
on the tiers of a config."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from typing import Any

from kvtier.cli import args as argtypes
from kvtier.cli.common import (
    NAMESPACE,
    PLACEHOLDER,
    TIER,
    add_command,
    confirm,
    emit,
    format_age,
    format_time,
    namespace_arg,
    resolve_namespace,
    table,
    tier_config,
)
from kvtier.cli.progress import Progress
from kvtier.idle import IDLE_FLOOR, PurgeOutcome, idle_plan, purge_idle
from kvtier.operations import default_journal, migrate, purge, verify
from tiering.config import Config, TierConfig, load_config, tier_from_config
from tiering.errors import ConfigError
from tiering.tier import NamespaceUsage
from tiering.units import format_duration, parse_duration

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
    p.add_argument(
        "--repair",
        action="store_true",
        help="delete the objects whose damage is provable (checksum, torn, lying header, "
        "not a kvtier object); objects this reader only cannot authenticate or use are "
        "left, and listed",
    )
    p.add_argument(
        "--delete-unauthenticated",
        action="store_true",
        help="with --repair: delete objects that fail authentication too (another secret's, "
        "or written without one) - only when no engine with another secret shares the store",
    )
    p = add_command(
        commands,
        "purge",
        "delete a namespace's blocks, or old ones, or every namespace not written for a time",
        run_purge,
        [TIER, NAMESPACE],
    )
    p.add_argument("--older-than", metavar="DURATION", help="only blocks written before, e.g. 7d")
    p.add_argument(
        "--idle-for",
        metavar="DURATION",
        help="every namespace of the tier's store not written for this long, e.g. 30d (with "
        "--namespace: that one, if it is idle); lists them only, unless --yes; each is read "
        "again just before it goes, and kept if written since; under "
        f"{format_duration(IDLE_FLOOR)} only with --force",
    )
    p.add_argument(
        "--yes",
        action="store_true",
        help="do not ask for confirmation (with --idle-for: purge, not only list)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help=f"with --idle-for and --yes: purge even when --idle-for is under "
        f"{format_duration(IDLE_FLOOR)}",
    )


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
            tier_from_config(source_cfg, namespace, config, read_only=not args.move) as source,
            tier_from_config(destination_cfg, namespace, config) as destination,
        ):
            bar = Progress.of(args, 0, f"migrate {source_cfg.name} -> {destination_cfg.name}")
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
    if args.delete_unauthenticated and not args.repair:
        raise ConfigError("--delete-unauthenticated: only with --repair")

    async def go() -> Any:
        namespace = await resolve_namespace(config, cfg, args.namespace)
        async with tier_from_config(cfg, namespace, config, read_only=not args.repair) as tier:
            bar = Progress.of(args, 0, f"verify {cfg.name}")
            report = await verify(
                tier,
                repair=args.repair,
                progress=bar.update,
                delete_unauthenticated=args.delete_unauthenticated,
            )
            bar.close()
        return report

    report = asyncio.run(go())
    lines = [
        f"checked {report.checked:,} blocks: {report.ok:,} ok, {len(report.bad):,} bad"
        + (f", {report.repaired:,} deleted, {len(report.left):,} left" if args.repair else "")
    ]
    lines += [f"  {key}: {reason}" for key, reason in report.bad[:50]]
    if args.repair and report.left:
        lines.append(_left_reasons(report.left, deleting_auth=args.delete_unauthenticated))
    emit(args, dataclasses.asdict(report), lines)
    return 1 if report.left or (report.bad and not args.repair) else 0


_WHY_LEFT = {
    "auth": "fail authentication: another secret's, or written without one",
    "namespace": "belong to another namespace",
    "version": "are of a kvtier format this one does not know",
    "codec": "use a codec this kvtier does not know",
}


def _left_reasons(left: list[tuple[str, str]], deleting_auth: bool) -> str:
    """Why a repair left objects in place, one line: each reason's count and what it means."""
    counts: dict[str, int] = {}
    for _, reason in left:
        counts[reason] = counts.get(reason, 0) + 1
    parts = [
        f"{n:,} {_WHY_LEFT.get(reason, f'refused ({reason})')}" for reason, n in counts.items()
    ]
    advice = (
        ""
        if deleting_auth or "auth" not in counts
        else " (--delete-unauthenticated deletes those that fail authentication)"
    )
    return (
        "left in place, as they may be a neighbour's (no damage is proven): "
        + "; ".join(parts)
        + advice
    )


def run_purge(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    cfg = tier_config(config, args.tier)
    if args.idle_for is not None:
        return _purge_idle(args, config, cfg)
    if args.namespace is None and args.older_than is None:
        raise ConfigError("purge: give --namespace, --older-than or --idle-for")
    older = None if args.older_than is None else parse_duration(args.older_than, "--older-than")

    async def go() -> int:
        namespace = await resolve_namespace(config, cfg, args.namespace)
        if not args.yes:
            what = f"blocks older than {args.older_than}" if older else "all blocks"
            if not confirm(
                f"delete {what} of namespace {namespace.hex()} in tier {cfg.name!r}? [y/N] "
            ):
                return -1
        async with tier_from_config(cfg, namespace, config) as tier:
            bar = Progress.of(args, 0, f"purge {cfg.name}")
            try:
                return await purge(tier, older, bar.update)
            finally:
                bar.close()

    deleted = asyncio.run(go())
    if deleted < 0:
        print("kvtier purge: nothing deleted", file=sys.stderr)
        return 1
    return emit(args, {"deleted": deleted}, [f"deleted {deleted:,} blocks"])


def _purge_idle(args: argparse.Namespace, config: Config, cfg: TierConfig) -> int:
    """`purge --idle-for`: every namespace of the tier's store whose last write is older
    (`Tier.usage`, `kvtier.idle.idle_plan`), or only `--namespace`; listed without `--yes`,
    each purged whole (or its blocks older than `--older-than`) with it if it is still idle
    when its turn comes (`kvtier.idle.purge_idle`). A namespace whose store cannot say when it
    was written is never taken; under `IDLE_FLOOR` only with `--force`."""
    idle_for = parse_duration(args.idle_for, "--idle-for")
    older = None if args.older_than is None else parse_duration(args.older_than, "--older-than")
    only = None if args.namespace is None else namespace_arg(args.namespace)
    if args.yes and cfg.options.get("read_only"):
        raise ConfigError(f"purge: tier {cfg.name!r} is read-only in the config")
    if args.yes and idle_for < IDLE_FLOOR and not args.force:
        raise ConfigError(
            f"--idle-for: {args.idle_for.strip()} is under {format_duration(IDLE_FLOOR)}, "
            "shorter than an engine in use may go without writing; add --force to purge anyway"
        )

    async def go() -> tuple[list[NamespaceUsage], list[NamespaceUsage], list[PurgeOutcome]]:
        async with tier_from_config(cfg, PLACEHOLDER, config, read_only=True) as probe:
            usage = await probe.usage()
        if only is not None:
            usage = [u for u in usage if u.namespace == only]
        plan = idle_plan(usage, idle_for)
        done: list[PurgeOutcome] = []
        if args.yes:
            bar = Progress.of(args, len(plan.idle), f"purge idle namespaces of {cfg.name}")
            done = await purge_idle(
                plan.idle, lambda ns: tier_from_config(cfg, ns, config), idle_for, older, bar.update
            )
            bar.close()
        return plan.idle, plan.unknown, done

    idle, unknown, done = asyncio.run(go())
    now = time.time()

    def shown(row: NamespaceUsage) -> dict[str, Any]:
        return {
            "namespace": row.namespace.hex(),
            "objects": row.objects,
            "bytes": row.bytes_used,
            "last_write": row.last_write,
        }

    data = {
        "tier": cfg.name,
        "idle_for": idle_for,
        "dry_run": not args.yes,
        "idle": [shown(row) for row in idle],
        "unknown_last_write": [shown(row) for row in unknown],
        "purged": [_outcome(d) for d in done if not d.kept],
        "kept_written_since": [_outcome(d) for d in done if d.kept],
        "deleted": sum(d.deleted for d in done),
    }
    verb = "purged" if args.yes else "would purge"
    kept = sum(d.kept for d in done)
    lines = [
        f"{verb} {len(idle) - kept:,} namespaces of tier {cfg.name!r} not written for "
        f"{format_age(idle_for)} ({sum(r.objects for r in idle):,} objects, "
        f"{sum(r.bytes_used for r in idle):,} bytes)"
        + ("" if args.yes or not idle else "; run again with --yes to purge them")
        + (f"; kept {kept:,} written since the plan" if kept else "")
    ]
    if idle:
        lines += table(
            [("namespace", "objects", "bytes", "last write", "idle")]
            + [
                (
                    r.namespace.hex(),
                    f"{r.objects:,}",
                    f"{r.bytes_used:,}",
                    format_time(r.last_write),
                    format_age(None if r.last_write is None else now - r.last_write),
                )
                for r in idle
            ]
        )
    for d in done:
        if d.error is not None:
            outcome = d.error
        elif d.kept:
            outcome = (
                "kept: written since the plan (last write "
                f"{format_age(None if d.last_write is None else now - d.last_write)} ago)"
            )
        else:
            outcome = f"deleted {d.deleted:,} blocks"
        lines.append(f"{d.namespace.hex()}: {outcome}")
    if unknown:
        lines.append(
            f"kept {len(unknown):,} namespaces whose last write the store cannot tell: "
            + ", ".join(r.namespace.hex() for r in unknown)
        )
    emit(args, data, lines)
    return 1 if any(d.error is not None for d in done) else 0


def _outcome(done: PurgeOutcome) -> dict[str, Any]:
    """One namespace's turn in `purge --idle-for --json`."""
    if done.error is not None:
        return {"namespace": done.namespace.hex(), "error": done.error}
    if done.kept:
        return {"namespace": done.namespace.hex(), "last_write": done.last_write}
    return {"namespace": done.namespace.hex(), "deleted": done.deleted}
