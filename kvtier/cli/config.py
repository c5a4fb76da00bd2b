"""`kvtier validate` and `kvtier show`: a config checked, and printed resolved."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from kvtier.cli.common import add_command, emit, redact
from tiering.config import load_config

__all__ = ["add_parsers", "run_show", "run_validate"]


def add_parsers(commands: Any) -> None:
    add_command(commands, "validate", "load and check a config", run_validate)
    add_command(commands, "show", "print a config resolved, secrets redacted", run_show)


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
    loaded = dataclasses.asdict(load_config(args.config))
    for tier in loaded["tiers"]:
        del tier["record"]  # (its options, each with its default: `options` shows those given)
    config = redact(loaded)
    if args.json:
        return emit(args, config, [])
    import yaml

    print(yaml.safe_dump(config, sort_keys=False), end="")
    return 0
