"""`kvtier manifest`: the warm-start manifest of use an engine left in a tier, shown (read-only:
the tier is opened read-only, nothing is written)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

from kvtier.cli import args as argtypes
from kvtier.cli.common import (
    NAMESPACE,
    TIER,
    add_command,
    emit,
    format_age,
    format_time,
    resolve_namespace,
    tier_config,
)
from tiering.config import load_config, tier_from_config
from tiering.errors import CorruptObject
from tiering.manager.manifest import ManifestRefused, decode, engine_identity, record_name

__all__ = ["add_parsers", "run_manifest"]


def add_parsers(commands: Any) -> None:
    p = add_command(
        commands,
        "manifest",
        "show the warm-start manifest of use an engine left in a tier (read-only)",
        run_manifest,
        [TIER, NAMESPACE],
    )
    p.add_argument(
        "--engine",
        help="the engine identity (default: primary.engine_id, else this host's default)",
    )
    p.add_argument(
        "--keys",
        type=argtypes.count(0),
        default=10,
        help="show this many of its keys, hottest first (default 10)",
    )


def run_manifest(args: argparse.Namespace) -> int:
    """The manifest's writer, age, keys and the writer's last warm start (planned, read,
    skipped, remaining and what it followed). Exit 1 when there is none, or it is refused."""
    config = load_config(args.config)
    cfg = tier_config(config, args.tier)

    async def gather() -> tuple[dict[str, Any] | None, str]:
        namespace = await resolve_namespace(config, cfg, args.namespace)
        engine = engine_identity(args.engine or config.primary.engine_id, namespace)
        async with tier_from_config(cfg, namespace, config, read_only=True) as tier:
            try:
                data = await tier.read_record(record_name(engine))
                if data is None:
                    return None, f"no manifest of engine {engine} in tier {cfg.name!r}"
                found = decode(data, tier.namespace, engine)
            except (CorruptObject, ManifestRefused) as e:
                return None, f"the manifest of engine {engine} is refused: {e}"
        warm = found.warm
        return {
            "engine": found.engine,
            "namespace": found.namespace.hex(),
            "host": found.host,
            "pid": found.pid,
            "written_at": found.written_at,
            "age_seconds": max(0.0, time.time() - found.written_at),
            "ended": found.ended,
            "blocks": len(found.keys),
            "warm_source": warm.source,
            "warm_planned": warm.planned,
            "warm_read": warm.read,
            "warm_skipped": warm.skipped,
            "warm_remaining": warm.remaining,
            "hottest": [key.hex() for key in found.keys[: args.keys]],
        }, ""

    shown, why = asyncio.run(gather())
    if shown is None:
        print(f"kvtier manifest: {why}", file=sys.stderr)
        return 1
    lines = [
        f"engine {shown['engine']} (namespace {shown['namespace']}), written by "
        f"{shown['host']} pid {shown['pid']} at {format_time(shown['written_at'])} "
        f"({format_age(shown['age_seconds'])} ago){', at its shutdown' if shown['ended'] else ''}",
        f"{shown['blocks']:,} blocks, hottest first",
        f"its warm start: followed {shown['warm_source']}; {shown['warm_planned']} planned, "
        f"{shown['warm_read']} read, {shown['warm_skipped']} skipped, "
        f"{shown['warm_remaining']} remaining",
        *shown["hottest"],
    ]
    return emit(args, shown, lines)
