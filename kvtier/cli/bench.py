"""`kvtier bench`: put and get throughput of a tier, beside the same bytes moved without kvtier
(`kvtier.baselines`)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from kvtier.cli import args as argtypes
from kvtier.cli.common import TIER, add_command, emit, table, tier_config
from kvtier.cli.progress import Progress
from kvtier.operations import purge_namespace
from tiering.config import Config, TierConfig, load_config, tier_from_config
from tiering.errors import ConfigError, KvtierError
from tiering.tier.format import MAX_BLOCK_BYTES
from tiering.units import parse_size

__all__ = ["add_parsers", "raw_baseline", "run_bench", "tier_throughput"]


def add_parsers(commands: Any) -> None:
    p = add_command(
        commands,
        "bench",
        "put and get throughput of a tier for several block sizes",
        run_bench,
        [TIER],
    )
    p.add_argument(
        "--sizes",
        type=argtypes.sizes(MAX_BLOCK_BYTES),
        default="64KiB,256KiB,2MiB",
        help="block sizes, comma-separated (default 64KiB,256KiB,2MiB); the bench holds up to "
        "8 + --clients blocks of a size in memory at once",
    )
    p.add_argument("--count", type=argtypes.count(1, 100_000), default=64, help="blocks per size")
    p.add_argument("--clients", type=argtypes.count(1, 256), default=8, help="calls in flight")


def tier_throughput(
    config: Config,
    cfg: TierConfig,
    size: int,
    count: int,
    clients: int,
    scratch: dict[str, Any],
) -> tuple[float, float]:
    """Put and get GiB/s of tier `cfg` for `count` blocks of `size`, `clients` calls in
    flight, in `scratch` space (`kvtier.baselines.scratch_space`) and a random namespace (no
    engine's): its blocks are removed afterwards, failed or not; the user's blocks, files,
    keys and objects are never touched."""
    from kvtier import baselines

    namespace = os.urandom(16)
    keyspace = baselines.REDIS_KEYSPACE if cfg.type == "redis" else None  # redis-benchmark's `-r`

    async def measure() -> tuple[float, float]:
        async with tier_from_config(cfg, namespace, config, **scratch) as tier:
            try:
                return await baselines.tier_rates(tier, size, count, clients, keyspace)
            finally:
                try:
                    await purge_namespace(tier)  # its blocks, and a marker of its own
                except KvtierError as e:  # say what is left; an error in flight stays
                    print(
                        f"kvtier: could not remove the bench's blocks (namespace "
                        f"{namespace.hex()}) from tier {cfg.name!r}: {e}",
                        file=sys.stderr,
                    )

    return asyncio.run(measure())


def run_bench(args: argparse.Namespace) -> int:
    from kvtier import baselines  # subprocess and boto3 helpers: only this command needs them

    config = load_config(args.config)
    cfg = tier_config(config, args.tier)
    sizes = [parse_size(s, "--sizes") for s in args.sizes.split(",")]
    if args.count < 1 or args.clients < 1:
        raise ConfigError("--count and --clients must be positive")
    # Blocks in a random namespace and, for file and S3 tiers, in scratch space of the bench's
    # own (`scratch_space`, `tier_throughput`).
    rows: list[dict[str, Any]] = []
    note = ""
    with baselines.scratch_space(cfg.type, cfg.options) as scratch:
        # per block size: the tier's puts and gets, then the raw baseline's writes and reads
        bar = Progress.of(args, 4 * args.count * len(sizes), f"bench {cfg.name}")
        for index, size in enumerate(sizes):
            put, get = tier_throughput(config, cfg, size, args.count, args.clients, scratch)
            bar.update((4 * index + 2) * args.count)
            try:
                baseline = raw_baseline(cfg, size, args.count, args.clients, scratch)
            except baselines.NoBaseline as e:
                baseline, note = None, str(e)
            bar.update((4 * index + 4) * args.count)
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
        bar.close()

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
    scratch space (`scratch`: the tier options `kvtier.baselines.scratch_space` gave). Raises
    `NoBaseline` where it cannot be measured."""
    from kvtier import baselines

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
