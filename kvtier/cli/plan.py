"""`kvtier plan`: what a primary and secondary tiers of each size would buy on a trace
(`kvtier.plan`), as a table, JSON and a picture (`kvtier.picture`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvtier.cli import args as argtypes
from kvtier.cli.common import JSON, table, tier_config
from kvtier.cli.progress import Progress
from kvtier.cli.replay import FLEET_BLOCK_BYTES, physical_memory
from kvtier.fleet import MAX_ENGINES, ROUTES, check_fleet
from kvtier.picture import FORMATS, Chart, Series, write_chart
from kvtier.plan import (
    DEFAULT_BANDWIDTH,
    PREFILL_RATE,
    PRIMARY,
    TOKEN_BYTES,
    Layer,
    PlanResult,
    Pricing,
    blocks_of,
    order_of,
    plan_fleet,
    run_plan,
)
from kvtier.trace import BLOCK_TOKENS, load_trace
from tiering.config import Config, load_config
from tiering.errors import ConfigError
from tiering.policies import get_policy_class
from tiering.units import parse_size

__all__ = ["add_parser", "run"]

MAX_CONFIGURATIONS = 512
"""The most configurations one sweep replays (each is a replay of the trace: ~0.5 s for the
shared trace's 12,000 requests)."""
MAX_BLOCKS = 10_000_000
"""The most blocks a layer may be given (`kvtier replay`'s bound: 5 PB of 512-token blocks of
Llama-3-8B; each block held costs the model ~100 bytes)."""
MAX_FLEET_CONFIGURATIONS = 64
"""The most fleet configurations one plan replays (each a fleet replay: ~40 s for 6,000
requests of 8 engines)."""
MEASURE_COUNT = 32
MEASURE_BLOCK = 2 << 20


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "plan",
        parents=[JSON],
        help="what each primary and tier size would buy on a trace: hit rates, time saved, "
        "a picture",
        description=(
            "Replay a request trace (Mooncake format) through the real primary pool and its "
            "policy, with a model of each secondary tier behind it (evicting by use, or by write "
            "order on S3), for every combination of the sizes given, and report per "
            "configuration the hit rate of each layer, the prompt tokens not recomputed, and "
            "the prefill time saved against the time the hits take to load. Sizes are blocks of "
            f"{BLOCK_TOKENS} tokens, or bytes with a unit (64GiB), turned into blocks with "
            "--token-bytes."
        ),
    )
    parser.add_argument("trace", metavar="TRACE", type=argtypes.path, help="JSONL trace file")
    parser.add_argument(
        "--primary",
        required=True,
        metavar="SIZE[,SIZE...]",
        help="primary sizes to try: blocks, or bytes with a unit",
    )
    parser.add_argument(
        "--policy",
        metavar="P[,P...]",
        help="eviction policies of the primary (default: the config's primary.eviction, else "
        "lru,arc)",
    )
    parser.add_argument(
        "--config",
        type=argtypes.path,
        help="a kvtier config: its tiers (medium, write mode, capacity) sit behind the primary",
    )
    parser.add_argument(
        "--tier",
        action="append",
        default=[],
        metavar="NAME[:MEDIUM[:WRITE]]=SIZE[,SIZE...]",
        help="sizes to try for a tier (one of the config's, or a new one: MEDIUM memory, file, "
        "redis or s3, default file; WRITE through, back or selective, default through); "
        "repeat for more tiers",
    )
    parser.add_argument(
        "--token-bytes",
        type=argtypes.count(1, 1 << 30),
        default=TOKEN_BYTES,
        help=f"KV bytes per token (default {TOKEN_BYTES:,}: Llama-3-8B in 16 bits)",
    )
    parser.add_argument(
        "--prefill-rate",
        type=float,
        default=PREFILL_RATE,
        help=f"prompt tokens per second a miss costs to prefill (default {PREFILL_RATE:g})",
    )
    parser.add_argument(
        "--bandwidth",
        action="append",
        default=[],
        metavar="NAME=GB/s",
        help="load bandwidth of a layer (primary, a tier's name, or a medium); defaults: "
        + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_BANDWIDTH.items()),
    )
    parser.add_argument(
        "--measure",
        action="store_true",
        help="with --config: measure each tier's get bandwidth as `kvtier bench` does "
        f"({MEASURE_COUNT} blocks of up to 2 MiB, in scratch space) instead of the defaults",
    )
    parser.add_argument(
        "--requests", type=argtypes.count(1, 10**9), help="replay only the first N requests"
    )
    parser.add_argument(
        "--engines",
        type=argtypes.count(1, MAX_ENGINES),
        metavar="N",
        help="a fleet: N engines of --primary blocks each over the config's one tier, shared "
        "(sizes: --tier NAME=BLOCKS,...); each configuration is a `kvtier replay --engines` run "
        "through the real managers and medium (about 40 s per 6,000 requests of 8 engines)",
    )
    parser.add_argument(
        "--route",
        choices=ROUTES,
        default="sticky",
        help="with --engines: how requests pick an engine (default sticky)",
    )
    parser.add_argument(
        "--seed",
        type=argtypes.count(0, 2**63 - 1),
        default=0,
        help="with --engines: the routing's seed (default 0)",
    )
    parser.add_argument(
        "--picture",
        type=Path,
        metavar="FILE",
        help="draw hit rate against capacity, one curve per policy and tier size "
        f"({', '.join(FORMATS)})",
    )
    parser.set_defaults(run=run)


def _sizes(text: str, what: str, token_bytes: int) -> list[int]:
    """Blocks of each comma-separated size in `text` (blocks, or bytes with a unit)."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise ConfigError(f"{what}: an empty size in {text!r}")
        blocks = int(part) if part.isdigit() else blocks_of(parse_size(part, what), token_bytes)
        if blocks > MAX_BLOCKS:
            raise ConfigError(f"{what}: {part} is {blocks:,} blocks, at most {MAX_BLOCKS:,}")
        out.append(blocks)
    return sorted(set(out))


def _tiers(args: argparse.Namespace, config: Config | None) -> list[tuple[Layer, list[int]]]:
    given: dict[str, tuple[Layer, list[int]]] = {}
    for spec in args.tier:
        head, sep, sizes = spec.partition("=")
        name, medium, write = (head.split(":") + [None, None])[:3]
        if not sep or not name:
            raise ConfigError(f"--tier {spec!r}: expected NAME[:MEDIUM[:WRITE]]=SIZE[,SIZE...]")
        base = None
        if config is not None and any(t.name == name for t in config.tiers):
            cfg = tier_config(config, name)
            base = Layer(name, cfg.type, 0, cfg.write, cfg.admit_after_hits, order_of(cfg))
        layer = base or Layer(name, "file", 0, "through")
        if medium:
            layer = Layer(name, medium, 0, layer.write, layer.admit_after_hits)
        if write:
            if write not in ("through", "back", "selective"):
                raise ConfigError(
                    f"--tier {spec!r}: write mode {write!r}, not through/back/selective"
                )
            layer = Layer(name, layer.medium, 0, write, layer.admit_after_hits, layer.order)
        given[name] = (layer, _sizes(sizes, f"--tier {name}", args.token_bytes))
    tiers = []
    for cfg in config.tiers if config is not None else ():
        if cfg.name in given:
            tiers.append(given.pop(cfg.name))
            continue
        if cfg.capacity is None:
            raise ConfigError(
                f"tier {cfg.name!r} has no capacity in the config: give it sizes with "
                f"--tier {cfg.name}=SIZE[,SIZE...]"
            )
        layer = Layer(cfg.name, cfg.type, 0, cfg.write, cfg.admit_after_hits, order_of(cfg))
        tiers.append((layer, [blocks_of(cfg.capacity, args.token_bytes)]))
    return tiers + list(given.values())


def _bandwidth(
    args: argparse.Namespace, config: Config | None, tiers: list[tuple[Layer, list[int]]]
) -> dict[str, float]:
    out: dict[str, float] = {}
    if args.measure:
        if config is None:
            raise ConfigError("--measure needs --config (the tiers to measure)")
        from kvtier import baselines
        from kvtier.cli.bench import tier_throughput

        size = min(MEASURE_BLOCK, BLOCK_TOKENS * args.token_bytes)
        for layer, _ in tiers:
            if not any(t.name == layer.name for t in config.tiers):
                continue
            cfg = tier_config(config, layer.name)
            with baselines.scratch_space(cfg.type, cfg.options) as scratch:
                _, get = tier_throughput(config, cfg, size, MEASURE_COUNT, 8, scratch)
            out[layer.name] = get * (1 << 30) / 1e9
    for spec in args.bandwidth:
        name, sep, value = spec.partition("=")
        try:
            gbps = float(value)
        except ValueError:
            gbps = 0.0
        if not sep or not name or not gbps > 0:
            raise ConfigError(f"--bandwidth {spec!r}: expected NAME=GB/s, a positive number")
        out[name] = gbps
    return out


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config) if args.config is not None else None
    if args.prefill_rate <= 0:
        raise ConfigError("--prefill-rate must be positive")
    if args.policy is not None:
        policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    elif config is not None:
        policies = [config.primary.eviction]
    else:
        policies = ["lru", "arc"]
    for name in policies:
        get_policy_class(name)
    primaries = _sizes(args.primary, "--primary", args.token_bytes)
    if not all(primaries):
        raise ConfigError("--primary: every size must hold at least one block")
    tiers = _tiers(args, config)
    if args.picture is not None and args.picture.suffix.lower() not in FORMATS:
        raise ConfigError(f"--picture {args.picture}: {' or '.join(FORMATS)}")
    if args.engines is not None:
        return _run_fleet(args, config, policies, primaries, tiers)
    count = len(policies) * len(primaries)
    for _, sizes in tiers:
        count *= len(sizes)
    if count > MAX_CONFIGURATIONS:
        raise ConfigError(f"{count} configurations; at most {MAX_CONFIGURATIONS} in one plan")
    pricing = Pricing(args.token_bytes, args.prefill_rate, _bandwidth(args, config, tiers))
    trace = load_trace(args.trace)
    requests = trace.requests[: args.requests] if args.requests else trace.requests
    progress = Progress.of(args, count, "plan")
    results = run_plan(requests, primaries, policies, tiers, pricing, progress.update)
    progress.close()
    return _report(args, str(trace.path), len(requests), pricing, results, primaries, tiers)


def _report(
    args: argparse.Namespace,
    path: str,
    requests: int,
    pricing: Pricing,
    results: list[PlanResult],
    primaries: list[int],
    tiers: list[tuple[Layer, list[int]]],
) -> int:
    chart = _chart(path, results, primaries, tiers)
    if args.picture is not None:
        write_chart(chart, args.picture)
    if args.json:
        data = _as_json(path, requests, pricing, results)
        if args.engines is not None:
            data |= {"engines": args.engines, "route": args.route, "seed": args.seed}
        print(json.dumps(data, indent=2))
    else:
        _print(path, requests, pricing, results, args.picture)
    return 0


def _run_fleet(
    args: argparse.Namespace,
    config: Config | None,
    policies: list[str],
    primaries: list[int],
    tiers: list[tuple[Layer, list[int]]],
) -> int:
    """`--engines`: each configuration a fleet replay (`kvtier.plan.plan_fleet`)."""
    if config is None:
        raise ConfigError("--engines needs --config FILE: the config of the tier they share")
    check_fleet(config, args.engines, args.route)
    ((_, sizes),) = tiers
    if args.measure:
        raise ConfigError("--measure is not supported with --engines: give --bandwidth")
    memory = physical_memory()
    need = args.engines * max(primaries) * FLEET_BLOCK_BYTES
    if need > memory:
        raise ConfigError(
            f"--engines {args.engines}: {need:,} bytes of primaries, this machine has {memory:,}"
        )
    count = len(policies) * len(primaries) * len(sizes)
    if count > MAX_FLEET_CONFIGURATIONS:
        raise ConfigError(
            f"--engines: {count} configurations; at most {MAX_FLEET_CONFIGURATIONS} in one plan"
        )
    pricing = Pricing(args.token_bytes, args.prefill_rate, _bandwidth(args, config, tiers))
    trace = load_trace(args.trace)
    requests = trace.requests[: args.requests] if args.requests else trace.requests
    progress = Progress.of(args, count, f"plan, {args.engines} engines")
    results = []
    for policy in policies:
        for blocks in sizes:
            for primary in primaries:
                results.append(
                    plan_fleet(
                        requests,
                        config,
                        args.engines,
                        primary,
                        policy,
                        blocks,
                        pricing,
                        args.route,
                        args.seed,
                        FLEET_BLOCK_BYTES,
                    )
                )
                progress.update(len(results))
    progress.close()
    return _report(args, str(trace.path), len(requests), pricing, results, primaries, tiers)


def _tiers_label(result: PlanResult) -> str:
    return ", ".join(f"{t.name} {t.blocks:,}" for t in result.layers)


def _chart(
    path: str,
    results: list[PlanResult],
    primaries: list[int],
    tiers: list[tuple[Layer, list[int]]],
) -> Chart:
    """Hit rate against the primary's size, one curve per policy and tier sizes; with one
    primary size, against the first tier tried at several sizes."""
    swept = next((layer.name for layer, sizes in tiers if len(sizes) > 1), None)
    by_tier = len(primaries) == 1 and swept is not None
    curves: dict[str, list[tuple[float, float]]] = {}
    for r in results:
        if by_tier:
            x = next(t.blocks for t in r.layers if t.name == swept)
            rest = ", ".join(f"{t.name} {t.blocks:,}" for t in r.layers if t.name != swept)
            label = r.policy + (f", {rest}" if rest else "")
        else:
            x = r.primary
            label = r.policy + (f", {_tiers_label(r)}" if r.layers else "")
        curves.setdefault(label, []).append((float(x), 100 * r.hit_rate))
    x_label = f"{swept} tier, blocks" if by_tier else "primary, blocks"
    series = tuple(Series(label, tuple(sorted(points))) for label, points in curves.items())
    return Chart(
        f"Prefix hit rate, {Path(path).name}", x_label, "hit rate, % of prompt tokens", series
    )


def _as_json(
    path: str, requests: int, pricing: Pricing, results: list[PlanResult]
) -> dict[str, Any]:
    return {
        "trace": path,
        "requests": requests,
        "measured_requests": requests - requests // 2,
        "block_tokens": BLOCK_TOKENS,
        "token_bytes": pricing.token_bytes,
        "prefill_rate": pricing.prefill_rate,
        "bandwidth_gb_s": pricing.bandwidth,
        "configurations": [r.as_json() for r in results],
    }


def _print(
    path: str, requests: int, pricing: Pricing, results: list[PlanResult], picture: Path | None
) -> None:
    layers = [PRIMARY] + [t.name for t in results[0].layers]
    print(
        f"trace {path}: {requests:,} requests, measured over the last "
        f"{requests - requests // 2:,}; "
        f"blocks of {BLOCK_TOKENS} tokens x {pricing.token_bytes:,} bytes; prefill "
        f"{pricing.prefill_rate:g} tokens/s"
    )
    header = (
        "policy",
        "primary",
        "tiers",
        "hit rate",
        *(f"{n} %" for n in layers),
        "tokens saved",
        "prefill saved s",
        "load s",
        "net s",
    )
    rows: list[tuple[str, ...]] = [header]
    for r in results:
        rows.append(
            (
                r.policy,
                f"{r.primary:,}",
                _tiers_label(r) or "-",
                f"{100 * r.hit_rate:.2f}%",
                *(f"{100 * r.rate(n):.2f}" for n in layers),
                f"{r.hits:,}",
                f"{r.saved_seconds:,.0f}",
                f"{r.load_seconds:,.0f}",
                f"{r.net_seconds:,.0f}",
            )
        )
    print("\n".join(table(rows)))
    if picture is not None:
        print(f"picture: {picture}")
