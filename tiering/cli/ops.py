"""Operator commands: validate, show, stats, ls, inspect, migrate, verify, purge, bench.

Each takes `--config FILE` (the YAML the engines use) and names tiers by their `name` there.
Tiers are namespaced by model layout: `--namespace HEX` picks one; without it, a tier holding
exactly one namespace uses that one.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tiering.cli import args as argtypes
from tiering.cli.progress import Progress
from tiering.config import Config, TierConfig, load_config
from tiering.errors import ConfigError, CorruptObject, TierError, TierUnavailable
from tiering.format import MAX_BLOCK_BYTES, check_object
from tiering.keys import BlockKey
from tiering.operations import default_journal, migrate, purge, read_block, verify
from tiering.tier import Tier, as_key
from tiering.units import parse_duration

__all__ = ["add_parsers"]

PLACEHOLDER = bytes(16)


def add_parsers(commands: Any) -> None:
    def command(
        name: str, help: str, run: Callable[[argparse.Namespace], int]
    ) -> argparse.ArgumentParser:  # noqa: A002
        parser: argparse.ArgumentParser = commands.add_parser(name, help=help, description=help)
        parser.add_argument("--config", type=argtypes.path, required=True, help="kvtier YAML file")
        parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
        parser.set_defaults(run=run)
        return parser

    command("validate", "load and check a config", run_validate)
    command("show", "print a config resolved, secrets redacted", run_show)
    p = command("stats", "objects, bytes, capacity and namespaces per tier", run_stats)
    p.add_argument("--tier", help="one tier (default: all)")
    p = command("ls", "list stored blocks and their headers", run_ls)
    p.add_argument("--tier", required=True)
    p.add_argument("--namespace")
    p.add_argument("--limit", type=argtypes.count(), default=50)
    p = command("inspect", "the header of one stored block, and whether it verifies", run_inspect)
    p.add_argument("--tier", required=True)
    p.add_argument("--namespace")
    p.add_argument("key", metavar="KEY", help="the block's key in hex")
    p = command("migrate", "copy or move blocks between two tiers", run_migrate)
    p.add_argument("--from", dest="source", required=True, metavar="TIER")
    p.add_argument("--to", dest="destination", required=True, metavar="TIER")
    p.add_argument(
        "--move", action="store_true", help="delete each source block once copied and verified"
    )
    p.add_argument("--namespace")
    p.add_argument("--older-than", metavar="DURATION", help="only blocks written before, e.g. 7d")
    p.add_argument("--dry-run", action="store_true", help="count what would be copied")
    p.add_argument("--verify", action="store_true", help="read every copy back and compare")
    p.add_argument("--resume", action="store_true", help="skip what an earlier run finished")
    p.add_argument(
        "--journal", type=argtypes.path, help="progress journal (default: under ~/.cache/kvtier)"
    )
    p.add_argument("--concurrency", type=argtypes.count(1, 1024), default=8)
    p = command("verify", "check every stored block's header and checksum", run_verify)
    p.add_argument("--tier", required=True)
    p.add_argument("--namespace")
    p.add_argument("--repair", action="store_true", help="delete corrupt and foreign objects")
    p = command("purge", "delete a namespace's blocks, or old ones", run_purge)
    p.add_argument("--tier", required=True)
    p.add_argument("--namespace")
    p.add_argument("--older-than", metavar="DURATION")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p = command("bench", "put and get throughput of a tier for several block sizes", run_bench)
    p.add_argument("--tier", required=True)
    p.add_argument("--sizes", type=argtypes.sizes(MAX_BLOCK_BYTES), default="64KiB,256KiB,2MiB")
    p.add_argument("--count", type=argtypes.count(1, 100_000), default=64, help="blocks per size")
    p.add_argument("--clients", type=argtypes.count(1, 256), default=8, help="calls in flight")


# -- helpers ------------------------------------------------------------------------------------


def tier_config(config: Config, name: str) -> TierConfig:
    for tier in config.tiers:
        if tier.name == name:
            return tier
    known = ", ".join(t.name for t in config.tiers) or "none"
    raise ConfigError(f"no tier named {name!r} in the config; tiers: {known}")


def make_tier(config: Config, cfg: TierConfig, namespace: bytes, **extra: Any) -> Tier:
    from tiering.registry import create_tier

    options = {"timeout": config.faults.timeout, **cfg.options, **extra}
    return create_tier(
        cfg.type,
        namespace=namespace,
        name=cfg.name,
        capacity=cfg.capacity,
        secret=config.auth.secret,
        **options,
    )


async def resolve_namespace(config: Config, cfg: TierConfig, given: str | None) -> bytes:
    if given is not None:
        try:
            namespace = bytes.fromhex(given)
        except ValueError:
            namespace = b""
        if len(namespace) != 16:
            raise ConfigError(f"--namespace: expected 32 hex digits, got {given!r}")
        return namespace
    async with make_tier(config, cfg, PLACEHOLDER, read_only=True) as probe:
        found = await probe.namespaces()
    if len(found) == 1:
        return found[0]
    if not found:
        raise ConfigError(f"tier {cfg.name!r} holds no blocks (give --namespace to be explicit)")
    listed = ", ".join(n.hex() for n in found)
    raise ConfigError(
        f"tier {cfg.name!r} holds several namespaces; pick one with --namespace: {listed}"
    )


def confirm(question: str) -> bool:
    """Ask on standard error (standard output is the command's result), read the answer from
    standard input; no answer (end of input, no input at all, bytes that are not text) is no."""
    print(question, end="", file=sys.stderr, flush=True)
    try:
        answer = sys.stdin.readline() if sys.stdin is not None else ""
    except (OSError, ValueError):  # closed, unreadable, not UTF-8 (UnicodeDecodeError)
        answer = ""
    if not answer.endswith("\n"):
        print(file=sys.stderr)  # the user's Enter did not end the prompt's line
    return answer.strip().lower() in ("y", "yes")


def emit(args: argparse.Namespace, data: Any, lines: list[str]) -> int:
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        print("\n".join(lines))
    return 0


def table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def redact(value: Any) -> Any:
    """A config as plain data, its secrets masked: options named like one, and credentials
    inside URLs or quoted in other strings (`tiering.secrets.redact_data`)."""
    from tiering.secrets import redact_data

    return redact_data(value)


# -- commands -----------------------------------------------------------------------------------


def run_validate(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    names = [f"{t.name} ({t.type}, write {t.write})" for t in config.tiers]
    return emit(
        args,
        {"valid": True, "tiers": [t.name for t in config.tiers]},
        [
            f"{args.config}: valid",
            "primary: "
            + (
                f"{config.primary.capacity:,} bytes"
                if config.primary.capacity
                else "vLLM's cpu_bytes_to_use"
            )
            + f", {config.primary.eviction}"
            + (", authenticated objects" if config.auth.secret else ""),
            "tiers: " + (", ".join(names) or "none"),
        ],
    )


def run_show(args: argparse.Namespace) -> int:
    config = redact(dataclasses.asdict(load_config(args.config)))
    if args.json:
        return emit(args, config, [])
    import yaml

    print(yaml.safe_dump(config, sort_keys=False), end="")
    return 0


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


def run_bench(args: argparse.Namespace) -> int:
    import os

    from tiering.errors import KvtierError
    from tiering.units import parse_size
    from tiers.baselines import REDIS_KEYSPACE, NoBaseline, scratch_space, tier_rates

    config = load_config(args.config)
    cfg = tier_config(config, args.tier)
    sizes = [parse_size(s, "--sizes") for s in args.sizes.split(",")]
    if args.count < 1 or args.clients < 1:
        raise ConfigError("--count and --clients must be positive")
    # Blocks in a random namespace (no engine's) and, for file and S3 tiers, in scratch space
    # of the bench's own (`scratch_space`): all removed afterwards, failed or not; the user's
    # blocks, files, keys and objects are never touched.
    namespace = os.urandom(16)
    keyspace = REDIS_KEYSPACE if cfg.type == "redis" else None  # redis-benchmark's `-r`

    rows: list[dict[str, Any]] = []
    note = ""
    with scratch_space(cfg.type, cfg.options) as scratch:

        async def measure(size: int) -> tuple[float, float]:
            async with make_tier(config, cfg, namespace, **scratch) as tier:
                try:
                    return await tier_rates(tier, size, args.count, args.clients, keyspace)
                finally:
                    try:
                        await purge(tier)
                    except KvtierError as e:  # say what is left; an error in flight stays
                        print(
                            f"kvtier bench: could not remove its blocks (namespace "
                            f"{namespace.hex()}) from tier {cfg.name!r}: {e}",
                            file=sys.stderr,
                        )

        for size in sizes:
            put, get = asyncio.run(measure(size))
            try:
                baseline = raw_baseline(cfg, size, args.count, args.clients, scratch)
            except NoBaseline as e:
                baseline, note = None, str(e)
            rows.append(
                {
                    "block_bytes": size,
                    "put_gib_s": put,
                    "get_gib_s": get,
                    "baseline": None if baseline is None else baseline[2],
                    "raw_write_gib_s": None if baseline is None else baseline[0],
                    "raw_read_gib_s": None if baseline is None else baseline[1],
                    "put_ratio": None if baseline is None else put / baseline[0],
                    "get_ratio": None if baseline is None else get / baseline[1],
                }
            )

    def ratio(value: Any) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = table(
        [("block", "put GiB/s", "raw write", "ratio", "get GiB/s", "raw read", "ratio")]
        + [
            (
                f"{r['block_bytes'] >> 10} KiB",
                f"{r['put_gib_s']:.2f}",
                ratio(r["raw_write_gib_s"]),
                ratio(r["put_ratio"]),
                f"{r['get_gib_s']:.2f}",
                ratio(r["raw_read_gib_s"]),
                ratio(r["get_ratio"]),
            )
            for r in rows
        ]
    )
    if rows and rows[0]["baseline"]:
        lines.append(f"baseline: {rows[0]['baseline']}, {args.clients} at a time")
    elif note:
        lines.append(f"baseline: none: {note}")
    return emit(args, rows, lines)


def raw_baseline(
    cfg: TierConfig, size: int, count: int, clients: int, scratch: dict[str, Any]
) -> tuple[float, float, str] | None:
    """The same bytes moved without kvtier, on the tier's own disk or server, in the bench's
    scratch space (`scratch`: the tier options `tiers.baselines.scratch_space` gave). Raises
    `NoBaseline` where it cannot be measured."""
    from tiers import baselines

    options = cfg.options
    if cfg.type == "file":
        write, read, tool = baselines.raw_disk(Path(scratch["path"]), size, count, clients)
        return write, read, f"{tool} O_DIRECT in {options['path']}"
    if cfg.type == "redis":
        from redis.asyncio.connection import parse_url

        url = str(options.get("url", "redis://127.0.0.1:6379/0"))
        if options.get("cluster") or not url.startswith("redis://") or options.get("tls_ca_file"):
            raise baselines.NoBaseline("redis-benchmark is run against plain-TCP servers only")
        where = parse_url(url)
        write, read = baselines.redis_benchmark(
            where.get("host", "127.0.0.1"),
            int(where.get("port", 6379)),
            size,
            count,
            clients,
            options.get("password") or where.get("password"),
            username=options.get("username") or where.get("username"),
            db=int(where.get("db", 0)),
        )
        return write, read, "redis-benchmark"
    if cfg.type == "s3":
        write, read = baselines.plain_boto3(
            options.get("endpoint_url"),
            options["bucket"],
            size,
            count,
            clients,
            options.get("access_key"),
            options.get("secret_key"),
            options.get("region"),
            prefix=scratch["prefix"],
        )
        return write, read, "plain boto3"
    return None
