"""`kvtier manifest`: the warm-start manifest of use an engine left in a tier, shown (read-only by
default: the tier is opened read-only, nothing is written); with `--write-now`, a running
engine asked to write its manifest now (`tiering.manager.request`: a request record in the
tier, which the engine looks for every few seconds), waited for and shown."""

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
from tiering.config import Config, TierConfig, load_config, tier_from_config
from tiering.errors import CorruptObject, TierError
from tiering.manager.manifest import (
    Manifest,
    ManifestRefused,
    decode,
    engine_identity,
    record_name,
)
from tiering.manager.request import (
    MAX_REQUEST_BYTES,
    ManifestRequest,
    decode_request,
    encode_request,
    request_name,
)
from tiering.tier import Tier

__all__ = ["add_parsers", "manifest_fields", "run_manifest"]

LOOK_EVERY = 0.25
"""Seconds between two looks of `--write-now` at its request (a small record's read)."""


def add_parsers(commands: Any) -> None:
    p = add_command(
        commands,
        "manifest",
        "show the warm-start manifest of use an engine left in a tier (read-only), or ask a "
        "running engine to write it now (--write-now)",
        run_manifest,
        [TIER, NAMESPACE],
    )
    p.add_argument(
        "--engine",
        "--engine-id",
        help="the engine identity (default: primary.engine_id, else this host's default)",
    )
    p.add_argument(
        "--keys",
        type=argtypes.count(0),
        default=10,
        help="show this many of its keys, hottest first (default 10)",
    )
    p.add_argument(
        "--write-now",
        action="store_true",
        help="ask the running engine of that identity to write its manifest now, through the "
        "tier (a request record, sealed like a block: with auth.secret only its holders can "
        "ask), and show the manifest it writes",
    )
    p.add_argument(
        "--wait",
        type=argtypes.count(1, 3600),
        default=30,
        metavar="SECONDS",
        help="with --write-now: how long to wait for the engine's answer (default 30)",
    )


def manifest_fields(found: Manifest, keys: int) -> dict[str, Any]:
    """What `kvtier manifest` shows of a manifest (its JSON)."""
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
        "hottest": [key.hex() for key in found.keys[:keys]],
    }


async def _stored(tier: Tier, engine: str) -> Manifest | None:
    """The manifest of `engine` in `tier`; None when there is none; `ManifestRefused` or
    `CorruptObject` when it is refused."""
    data = await tier.read_record(record_name(engine))
    return None if data is None else decode(data, tier.namespace, engine)


def run_manifest(args: argparse.Namespace) -> int:
    """The manifest's writer, age, keys and the writer's last warm start (planned, read,
    skipped, remaining and what it followed). Exit 1 when there is none, it is refused, or
    (`--write-now`) no running engine answered within `--wait` seconds."""
    config = load_config(args.config)
    cfg = tier_config(config, args.tier)

    async def gather() -> tuple[dict[str, Any] | None, str]:
        namespace = await resolve_namespace(config, cfg, args.namespace)
        engine = engine_identity(args.engine or config.primary.engine_id, namespace)
        if args.write_now:
            return await write_now(config, cfg, namespace, engine, args)
        async with tier_from_config(cfg, namespace, config, read_only=True) as tier:
            try:
                found = await _stored(tier, engine)
            except (CorruptObject, ManifestRefused) as e:
                return None, f"the manifest of engine {engine} is refused: {e}"
        if found is None:
            return None, f"no manifest of engine {engine} in tier {cfg.name!r}"
        return manifest_fields(found, args.keys), ""

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


async def write_now(
    config: Config, cfg: TierConfig, namespace: bytes, engine: str, args: argparse.Namespace
) -> tuple[dict[str, Any] | None, str]:
    """Ask engine `engine` to write its manifest now through tier `cfg`: store a request, wait
    until the engine removes it (it answers with a write first), then show the manifest, which
    must differ from the one stored before the request. On timeout the request is taken back
    (when it is still ours) and no running engine of that identity answered."""
    name = request_name(engine)
    async with tier_from_config(cfg, namespace, config) as tier:
        if not tier.persistent:  # an engine's own memory: no other process reads it
            return None, (
                f"tier {cfg.name!r} ({cfg.type}) is no store an engine shares: ask through a "
                "persistent tier"
            )
        try:
            before = await _stored(tier, engine)
        except (CorruptObject, ManifestRefused):
            before = None
        request = ManifestRequest(engine)
        if not await tier.write_record(name, encode_request(request)):
            return None, f"tier {cfg.name!r} keeps no records: no engine can be asked there"
        print(
            f"kvtier manifest: asked engine {engine} through tier {cfg.name!r}; waiting up to "
            f"{args.wait} s",
            file=sys.stderr,
            flush=True,
        )
        deadline = time.monotonic() + args.wait
        while time.monotonic() < deadline:
            await asyncio.sleep(LOOK_EVERY)
            if await tier.read_record(name, MAX_REQUEST_BYTES) is not None:
                continue
            try:
                found = await _stored(tier, engine)
            except (CorruptObject, ManifestRefused) as e:
                return None, f"engine {engine} answered, but its manifest is refused: {e}"
            if found is None or (
                before is not None
                and (found.session, found.written_at) == (before.session, before.written_at)
            ):
                return None, (
                    f"the request to engine {engine} was removed unanswered (refused: is this "
                    "config's auth.secret the engine's?)"
                )
            return manifest_fields(found, args.keys) | {
                "answered_seconds": args.wait - (deadline - time.monotonic())
            }, ""
        try:
            data = await tier.read_record(name, MAX_REQUEST_BYTES)
            if data is not None and decode_request(data, engine).nonce == request.nonce:
                await tier.delete_record(name)
        except (TierError, ManifestRefused):
            pass  # a request left behind is answered by the engine's next start: one write
    return None, (
        f"no running engine with identity {engine} answered within {args.wait} s "
        f"(asked through tier {cfg.name!r}; an engine with primary.manifest_requests: 0 "
        "never looks)"
    )
