"""The `kvtier` command line: `main` builds the parser from one module per command group
(`config`: validate, show; `inspection`: stats, ls, inspect; `ops`: migrate, verify, purge;
`secrets`: rekey; `bench`; `replay`; `plan`; `top`; `demo`), whose shared options are
argparse parent parsers (`common`).

Every command prints a readable table by default and JSON with `--json`, and exits non-zero
with a one-line reason on error: 2 for bad usage (arguments, names, config), 1 for anything
else that went wrong (a tier that fails, a file that cannot be written). A traceback never
reaches the user: an exception kvtier did not expect is one line that says it is a bug
(`KVTIER_DEBUG=1` prints its traceback too).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence

import kvtier
from kvtier.cli import (
    bench,
    config,
    demo,
    inspection,
    manifests,
    ops,
    plan,
    replay,
    secrets,
    top,
)
from tiering.errors import ConfigError, KeyFormatError, KvtierError
from tiering.secrets import redact_text

__all__ = ["build_parser", "main"]

EXIT_ERROR = 1
EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier",
        description="Multi-tier KV-cache storage for vLLM: inspect, move and measure cached KV.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {kvtier.__version__}",
        help="print kvtier's version and exit",
    )
    commands = parser.add_subparsers(
        dest="command",
        metavar="COMMAND",
        required=True,
        help="what to do (COMMAND -h: its options)",
    )
    demo.add_parser(commands)
    replay.add_parser(commands)
    plan.add_parser(commands)
    top.add_parser(commands)
    config.add_parsers(commands)
    inspection.add_parsers(commands)
    manifests.add_parsers(commands)
    ops.add_parsers(commands)
    secrets.add_parsers(commands)
    bench.add_parsers(commands)
    return parser


def _one_line(error: BaseException) -> str:
    """The error's message on one line, any URL's password in it masked (`tiering.secrets`:
    the tiers mask theirs and their secrets; this catches one a library quoted elsewhere)."""
    return " ".join(redact_text(str(error)).split()) or type(error).__name__


def _quiet_stdout() -> None:
    """Point standard output at /dev/null, so that flushing it at exit does not complain of
    the pipe its reader closed."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # not a file (captured, replaced)
        pass


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # a usage error exits 2 with argparse's one line
    name = f"kvtier {args.command}"
    try:
        code: int = args.run(args)
    except (ConfigError, KeyFormatError) as e:
        print(f"{name}: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except KvtierError as e:
        print(f"{name}: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `kvtier ls ... | head`: the reader has all it wanted
        _quiet_stdout()
        return EXIT_ERROR
    except OSError as e:  # the machine's refusal (space, permissions), not the user's input
        where = f"{e.filename}: " if e.filename else ""
        print(f"{name}: error: {where}{e.strerror or _one_line(e)}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as e:
        print(
            f"{name}: internal error: {type(e).__name__}: {_one_line(e)} (this is a bug in "
            "kvtier, please report it with the command; KVTIER_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        if os.environ.get("KVTIER_DEBUG"):
            traceback.print_exc()
        return EXIT_ERROR
    return code
