"""What the operator commands share: their common options (argparse parent parsers), finding a
tier of the config and opening it, picking its namespace, and printing a result.

Each command takes `--config FILE` (the YAML the engines use) and names tiers by their `name`
there. Tiers are namespaced by model layout: `--namespace HEX` picks one; without it, a tier
holding exactly one namespace uses that one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.cli import args as argtypes
from kvtier.operations import PLACEHOLDER
from tiering.config import Config, TierConfig, tier_from_config
from tiering.errors import ConfigError

__all__ = [
    "CONFIG",
    "JSON",
    "NAMESPACE",
    "PLACEHOLDER",
    "TIER",
    "add_command",
    "confirm",
    "emit",
    "format_age",
    "format_time",
    "namespace_arg",
    "redact",
    "resolve_namespace",
    "table",
    "tier_config",
]


def _parent() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(add_help=False)


CONFIG = _parent()
CONFIG.add_argument("--config", type=argtypes.path, required=True, help="kvtier YAML file")

JSON = _parent()
JSON.add_argument("--json", action="store_true", help="print JSON instead of a table")

TIER = _parent()
TIER.add_argument("--tier", required=True, help="the tier, by its name in the config")

NAMESPACE = _parent()
NAMESPACE.add_argument(
    "--namespace",
    metavar="HEX",
    help="the namespace, 32 hex digits (default: the one the tier holds, if it holds one)",
)


def add_command(
    commands: Any,
    name: str,
    summary: str,
    run: Callable[[argparse.Namespace], int],
    parents: Sequence[argparse.ArgumentParser] = (),
) -> argparse.ArgumentParser:
    """A subcommand of `kvtier` taking `--config` and `--json`, and the options of `parents`."""
    parser: argparse.ArgumentParser = commands.add_parser(
        name, help=summary, description=summary, parents=[CONFIG, JSON, *parents]
    )
    parser.set_defaults(run=run)
    return parser


def tier_config(config: Config, name: str) -> TierConfig:
    for tier in config.tiers:
        if tier.name == name:
            return tier
    known = ", ".join(t.name for t in config.tiers) or "none"
    raise ConfigError(f"no tier named {name!r} in the config; tiers: {known}")


def namespace_arg(given: str) -> bytes:
    """A namespace given as `--namespace` (32 hex digits); ConfigError naming the flag."""
    try:
        namespace = bytes.fromhex(given)
    except ValueError:
        namespace = b""
    if len(namespace) != 16:
        raise ConfigError(f"--namespace: expected 32 hex digits, got {given!r}")
    return namespace


async def resolve_namespace(config: Config, cfg: TierConfig, given: str | None) -> bytes:
    if given is not None:
        return namespace_arg(given)
    async with tier_from_config(cfg, PLACEHOLDER, config, read_only=True) as probe:
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


def format_time(when: float | None) -> str:
    """A Unix time as local date and time, `-` for unknown."""
    return "-" if when is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when))


def format_age(seconds: float | None) -> str:
    """A duration in its two largest units (`3d 4h`, `5m 10s`), `-` for unknown."""
    if seconds is None:
        return "-"
    left = max(0, int(seconds))
    parts: list[str] = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if left >= size or (unit == "s" and not parts):
            parts.append(f"{left // size}{unit}")
            left %= size
    return " ".join(parts[:2])


def table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def redact(value: Any) -> Any:
    """A config as plain data, its secrets masked: options named like one, and credentials
    inside URLs or quoted in other strings (`tiering.secrets.redact_data`)."""
    from tiering.secrets import redact_data

    return redact_data(value)
