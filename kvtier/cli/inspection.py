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
    format_age,
    format_time,
    resolve_namespace,
    table,
    tier_config,
)
from kvtier.cli.manifests import manifest_fields
from kvtier.operations import read_block
from tiering.config import Config, TierConfig, load_config, tier_from_config
from tiering.errors import CorruptObject, TierError, TierUnavailable
from tiering.keys import BlockKey
from tiering.manager.manifest import ManifestRefused, decode, engine_identity, record_name
from tiering.tier import NamespaceUsage, Tier, as_key
from tiering.tier.format import check_object

__all__ = ["add_parsers", "header_fields", "run_inspect", "run_ls", "run_stats"]

SHOWN_MANIFESTS = 100
"""The most manifests `kvtier stats` reads per tier and namespace (each is read whole)."""
MANIFEST_PREFIX = record_name("")


def add_parsers(commands: Any) -> None:
    p = add_command(
        commands,
        "stats",
        "every namespace of each tier's store (objects, bytes, last write), totals, capacity",
        run_stats,
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
    """Every namespace each tier's store holds, whoever wrote it (`Tier.usage`), with the
    store's totals and the tier's capacity, this engine's last manifest of use there
    (`primary.engine_id`, else this host's identity): its age and its writer's warm start as
    it stood then (`warm`), and every engine's manifest there (`manifests`, listed: at most
    `SHOWN_MANIFESTS` a tier and namespace, `manifests_more` when there are more), and the
    order its sweeper removes objects in now (`sweep_order`, `sweep_order`'s). JSON: one
    row per tier and namespace (a tier holding none: one row, namespace null), each with the
    store's totals beside."""
    config = load_config(args.config)
    chosen = [tier_config(config, args.tier)] if args.tier else list(config.tiers)
    now = time.time()

    async def gather() -> list[dict[str, Any]]:
        rows = []
        for cfg in chosen:
            async with tier_from_config(cfg, PLACEHOLDER, config, read_only=True) as probe:
                usage = await probe.usage()
                order = await sweep_order(probe)
            store: dict[str, Any] = {
                "tier": cfg.name,
                "type": cfg.type,
                "capacity": cfg.capacity,
                "store_objects": sum(u.objects for u in usage),
                "store_bytes": sum(u.bytes_used for u in usage),
                "sweep_order": order,
            }
            listed: list[NamespaceUsage | None] = [*usage] or [None]
            for u in listed:
                warm = None if u is None else await last_warm_start(config, cfg, u.namespace, now)
                shown, more = ([], False) if u is None else await manifests(config, cfg, u, now)
                rows.append(
                    store
                    | {
                        "namespace": None if u is None else u.namespace.hex(),
                        "objects": 0 if u is None else u.objects,
                        "bytes": 0 if u is None else u.bytes_used,
                        "last_write": None if u is None else u.last_write,
                        "idle_seconds": None
                        if u is None or u.last_write is None
                        else max(0.0, now - u.last_write),
                        "warm": warm,
                        "manifests": shown,
                        "manifests_more": more,
                    }
                )
        return rows

    rows = asyncio.run(gather())
    lines: list[tuple[str, ...]] = [
        ("tier", "type", "namespace", "objects", "bytes", "last write", "idle", "capacity", "warm")
    ]
    for r in rows:
        if r["namespace"] is not None:
            lines.append(
                (
                    r["tier"],
                    r["type"],
                    r["namespace"],
                    f"{r['objects']:,}",
                    f"{r['bytes']:,}",
                    format_time(r["last_write"]),
                    format_age(r["idle_seconds"]),
                    "",
                    warm_line(r["warm"]),
                )
            )
    for tier in dict.fromkeys(r["tier"] for r in rows):
        r = next(r for r in rows if r["tier"] == tier)
        capacity = r["capacity"]
        lines.append(
            (
                tier,
                r["type"],
                "(store total)",
                f"{r['store_objects']:,}",
                f"{r['store_bytes']:,}",
                "",
                "",
                f"{capacity:,}" if capacity else "-",
                "",
            )
        )
    orders = [
        f"tier {tier}, its sweeper's order: {order['line']}"
        for tier, order in {r["tier"]: r["sweep_order"] for r in rows}.items()
        if order is not None
    ]
    return emit(args, rows, table(lines) + manifest_lines(rows) + orders)


async def sweep_order(tier: Tier) -> dict[str, Any] | None:
    """The order in which the sweeper of `tier`'s store removes objects now, where the tier
    says (an S3 tier with `capacity`: `S3Tier.sweep_order`, read from the live manifests of
    use as its sweeper reads them), else None: `order` ("use" or "write"), `live_manifests`,
    `named_keys`, `stale_manifests`, `refused_manifests` and the `line` shown."""
    asked = getattr(tier, "sweep_order", None)
    named = None if asked is None else await asked()
    return None if named is None else named.fields() | {"line": named.line()}


async def manifests(
    config: Config, cfg: TierConfig, usage: NamespaceUsage, now: float
) -> tuple[list[dict[str, Any]], bool]:
    """Every engine's manifest of use in the namespace of `usage` (`Tier.list_records`), as
    `manifest_fields` with its age: at most `SHOWN_MANIFESTS` of them (each is read whole to be
    verified), and whether there are more. A refused one is shown as refused."""
    shown: list[dict[str, Any]] = []
    async with tier_from_config(cfg, usage.namespace, config, read_only=True) as tier:
        names = await tier.list_records(MANIFEST_PREFIX, SHOWN_MANIFESTS + 1)
        for name in names[:SHOWN_MANIFESTS]:
            engine = name[len(MANIFEST_PREFIX) :]
            try:
                data = await tier.read_record(name)
                if data is None:
                    continue  # removed since the listing
                found = decode(data, usage.namespace, engine)
            except (CorruptObject, ManifestRefused) as e:
                shown.append({"engine": engine, "refused": str(e)})
                continue
            fields = manifest_fields(found, 0)
            del fields["hottest"], fields["namespace"]
            shown.append(fields | {"age_seconds": max(0.0, now - found.written_at)})
    return shown, len(names) > SHOWN_MANIFESTS


def manifest_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The manifests of `rows` as a table of their own (none: no lines)."""
    lines: list[tuple[str, ...]] = [
        ("tier", "namespace", "engine", "age", "blocks", "ended", "host", "its warm start")
    ]
    for r in rows:
        for m in r["manifests"]:
            where = (r["tier"], r["namespace"], m["engine"])
            if "refused" in m:
                lines.append((*where, "", "", "", "", f"refused ({m['refused']})"))
                continue
            lines.append(
                (
                    *where,
                    format_age(m["age_seconds"]),
                    f"{m['blocks']:,}",
                    "yes" if m["ended"] else "no",
                    f"{m['host']} pid {m['pid']}",
                    f"{m['warm_source']}, {m['warm_read']}/{m['warm_planned']} read, "
                    f"{m['warm_skipped']} skipped, {m['warm_remaining']} left",
                )
            )
        if r["manifests_more"]:
            lines.append((r["tier"], r["namespace"], f"(more than {SHOWN_MANIFESTS})", *[""] * 5))
    return ["", "manifests of use:", *table(lines)] if len(lines) > 1 else []


async def last_warm_start(
    config: Config, cfg: TierConfig, namespace: bytes, now: float
) -> dict[str, Any] | None:
    """This engine's manifest of use in `namespace` of tier `cfg`, as `kvtier stats` shows it:
    its age and blocks, and its writer's warm start as it stood at the write; None when there
    is none (or the tier keeps no records), `{"refused": why}` when it is refused."""
    engine = engine_identity(config.primary.engine_id, namespace)
    async with tier_from_config(cfg, namespace, config, read_only=True) as tier:
        try:
            data = await tier.read_record(record_name(engine))
            if data is None:
                return None
            found = decode(data, namespace, engine)
        except (CorruptObject, ManifestRefused) as e:
            return {"engine": engine, "refused": str(e)}
    w = found.warm
    return {
        "engine": engine,
        "age_seconds": max(0.0, now - found.written_at),
        "blocks": len(found.keys),
        "ended": found.ended,
        "interval_seconds": found.interval,
        **{f"warm_{f}": getattr(w, f) for f in ("source", "planned", "read", "skipped")},
        "warm_remaining": w.remaining,
    }


def warm_line(warm: dict[str, Any] | None) -> str:
    if warm is None:
        return ""
    if "refused" in warm:
        return f"manifest refused ({warm['refused']})"
    return (
        f"manifest of {warm['blocks']:,} blocks, {format_age(warm['age_seconds'])} old; its "
        f"warm start: {warm['warm_source']}, {warm['warm_read']}/{warm['warm_planned']} read, "
        f"{warm['warm_skipped']} skipped, {warm['warm_remaining']} left"
    )


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
            "seal": header.scheme,
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
        async with tier_from_config(cfg, namespace, config, read_only=True) as tier:
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
                    format_time(r["written"]),
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
        async with tier_from_config(cfg, namespace, config, read_only=True) as tier:
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
