"""The `kvtier` command line.

Every command prints a readable table by default and JSON with `--json`, and exits non-zero
with a one-line reason on error: 2 for bad usage (arguments, names, config), 1 for anything
else that went wrong.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tiering.cli import demo, ops, replay
from tiering.errors import ConfigError, KeyFormatError, KvtierError

__all__ = ["build_parser", "main"]

EXIT_ERROR = 1
EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier",
        description="Multi-tier KV-cache storage for vLLM: inspect, move and measure cached KV.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo.add_parser(commands)
    replay.add_parser(commands)
    ops.add_parsers(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.run(args)
    except (ConfigError, KeyFormatError) as e:
        print(f"kvtier {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KvtierError as e:
        print(f"kvtier {args.command}: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"kvtier {args.command}: interrupted", file=sys.stderr)
        return 130
    return code
