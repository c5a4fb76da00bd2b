"""`kvtier stats`, `kvtier ls` and `kvtier inspect`: what a tier holds, opened read-only (they
work on a directory a running engine holds)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

from kvtier.cli import args as argtypes
from kvtier.cli.common import (
    NAMESPACE,
    PLACEHOLDER,
    TIER,
    add_command,
    emit,
    make_tier,
    resolve_namespace,
    table,
    tier_config,
)
from kvtier.operations import read_block
from tiering.config import load_config
from tiering.errors import CorruptObject, TierError, TierUnavailable
from tiering.format import check_object
from tiering.keys import BlockKey
from tiering.tier import Tier, as_key

__all__ = ["add_parsers", "header_fields", "run_inspect", "run_ls", "run_stats"]


def add_parsers(commands: Any) -> None:
    p = add_command(
        commands, "stats", "objects, bytes, capacity and namespaces per tier", run_stats
    )
    p.add_argument("--tier", help="one tier, by its name in the config (default: all)")
    p = add_command(
        commands, "ls", "list stored blocks and their headers", run_ls, [TIER, NAMESPACE]
    )
    p.add_argument(
        "--limit", type=argtypes.count(), default=50, help="list at most this many (default 50)"
    )
    p = add_command(
        commands,
        "inspect",
        "the header of one stored block, and whether it verifies",
        run_inspect,
        [TIER, NAMESPACE],
    )
    p.add_argument("key", metavar="KEY", help="the block's key in hex")


def run_stats(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    chosen = [tier_config(config, args.tier)] if args.tier else list(config.tiers)

    async def gather() -> list[dict[str, Any]]:
        rows = []
        for cfg in chosen:
            async with make_tier(config, cfg, PLACEHOLDER, read_only=True) as probe:
                namespaces = await probe.namespaces()
            for namespace in namespaces:
                async with make_tier(config, cfg, namespace, read_only=True) as tier:
                    stat = await tier.stat()
                rows.append(
                    {
                        "tier": cfg.name,
                        "type": cfg.type,
                        "namespace": namespace.hex(),
                        "objects": stat.objects,
                        "bytes": stat.bytes_used,
                        "capacity": stat.capacity,
                    }
                )
            if not namespaces:
                rows.append(
                    {
                        "tier": cfg.name,
                        "type": cfg.type,
                        "namespace": None,
                        "objects": 0,
                        "bytes": 0,
                        "capacity": cfg.capacity,
                    }
                )
        return rows

    rows = asyncio.run(gather())
    lines = table(
        [("tier", "type", "namespace", "objects", "bytes", "capacity")]
        + [
            (
                r["tier"],
                r["type"],
                r["namespace"] or "-",
                f"{r['objects']:,}",
                f"{r['bytes']:,}",
                f"{r['capacity']:,}" if r["capacity"] else "-",
            )
            for r in rows
        ]
    )
    return emit(args, rows, lines)


async def header_fields(tier: Tier, key: BlockKey) -> dict[str, Any]:
    """What `ls` and `inspect` show of a stored object: its header's fields, read without its
    payload (an object of any claimed size costs one small read), and what is wrong with the
    header or the object's size, if anything."""
    try:
        head = await tier.read_head(key)
    except CorruptObject as e:
        return {"key": key.hex(), "found": True, "problem": str(e)}
    if head is None:
        return {"key": key.hex(), "found": False}
    blob, size = head
    fields: dict[str, Any] = {"key": key.hex(), "found": True, "object_bytes": size}
    try:
        header = tier.decode_header(key, blob)
        fields |= {
            "codec": header.codec,
            "checksum": header.checksum_kind,
            "authenticated": header.mac is not None,
            "payload_offset": header.payload_offset,
            "stored_bytes": header.stored_length,
            "block_bytes": header.raw_length,
            "namespace": header.namespace.hex(),
        }
        check_object(header, size)
    except CorruptObject as e:
        fields["problem"] = str(e)
    return fields


def run_ls(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    cfg = tier_config(config, args.tier)

    async def gather() -> list[dict[str, Any]]:
        namespace = await resolve_namespace(config, cfg, args.namespace)
        rows = []
        async with make_tier(config, cfg, namespace, read_only=True) as tier:
            async for info in tier.entries():
                fields = await header_fields(tier, info.key)
                fields["written"] = info.modified
                rows.append(fields)
                if len(rows) >= args.limit:
                    break
        return rows

    rows = asyncio.run(gather())
    lines = (
        table(
            [("key", "block bytes", "stored", "codec", "checksum", "written")]
            + [
                (
                    r["key"],
                    str(r.get("block_bytes", "?")),
                    str(r.get("stored_bytes", "?")),
                    r.get("codec", r.get("problem", "?")),
                    r.get("checksum", ""),
                    time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["written"]))
                    if r["written"]
                    else "-",
                )
                for r in rows
            ]
        )
        if rows
        else ["no blocks"]
    )
    return emit(args, rows, lines)


def run_inspect(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    cfg = tier_config(config, args.tier)
    key = as_key(args.key)

    async def gather() -> dict[str, Any]:
        namespace = await resolve_namespace(config, cfg, args.namespace)
        async with make_tier(config, cfg, namespace, read_only=True) as tier:
            fields = await header_fields(tier, key)
            if fields["found"] and "problem" not in fields:
                try:
                    await read_block(tier, key)
                    fields["verified"] = True
                except CorruptObject as e:
                    fields["verified"] = False
                    fields["problem"] = str(e)
                except TierUnavailable:
                    raise
                except TierError as e:  # a deadline on a large object, an odd reply
                    fields["verified"] = False
                    fields["problem"] = f"cannot be read: {e}"
        return fields

    fields = asyncio.run(gather())
    if not fields["found"]:
        print(f"kvtier inspect: block {key.hex()} is not in tier {cfg.name!r}", file=sys.stderr)
        return 1
    return emit(args, fields, [f"{k}: {v}" for k, v in fields.items()])
