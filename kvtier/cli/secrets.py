"""`kvtier rekey`: the blocks stored under a previous secret rewritten under the current one
(`kvtier.rekey`), in the `kvtier` process's main thread."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from kvtier.cli import args as argtypes
from kvtier.cli.common import NAMESPACE, TIER, add_command, emit, namespace_arg, tier_config
from kvtier.cli.progress import Progress
from tiering.config import load_config

__all__ = ["add_parsers", "run_rekey"]


def add_parsers(commands: Any) -> None:
    p = add_command(
        commands,
        "rekey",
        "rewrite a tier's blocks stored under auth.previous's secrets under auth.secret",
        run_rekey,
        [TIER, NAMESPACE],
    )
    p.add_argument(
        "--keep", action="store_true", help="leave the old copies (default: removed once rewritten)"
    )
    p.add_argument("--dry-run", action="store_true", help="count what would be rewritten")
    p.add_argument("--resume", action="store_true", help="skip what an earlier run finished")
    p.add_argument(
        "--concurrency",
        type=argtypes.count(1, 1024),
        default=8,
        help="blocks rewritten at a time (default 8)",
    )


def run_rekey(args: argparse.Namespace) -> int:
    from kvtier.rekey import rekey

    config = load_config(args.config)
    cfg = tier_config(config, args.tier)
    namespace = None if args.namespace is None else namespace_arg(args.namespace)
    bar = Progress.of(args, 0, f"rekey {cfg.name}")
    moves = asyncio.run(
        rekey(
            config,
            cfg,
            args.config,
            namespace=namespace,
            keep=args.keep,
            dry_run=args.dry_run,
            resume=args.resume,
            concurrency=args.concurrency,
            progress=bar.update,
        )
    )
    bar.close()
    failed = sum(m.summary.failed for m in moves)
    verb = "would rewrite" if args.dry_run else "rewrote"
    lines = [
        f"{m.source.hex()} -> {m.destination.hex()}: {verb} "
        f"{m.summary.planned if args.dry_run else m.summary.copied:,} blocks, skipped "
        f"{m.summary.skipped:,}, failed {m.summary.failed:,}"
        + ("" if args.keep or args.dry_run else f", removed {m.summary.moved:,} old copies")
        for m in moves
    ] or [f"tier {cfg.name!r} holds no block under a previous secret"]
    lines += [error for m in moves for error in m.summary.errors[:10]]
    data = {
        "dry_run": args.dry_run,
        "namespaces": [
            {
                "from": m.source.hex(),
                "to": m.destination.hex(),
                "journal": str(m.journal),
                **vars(m.summary),
            }
            for m in moves
        ],
    }
    emit(args, data, lines)
    return 1 if failed else 0
