"""`kvtier demo`: kvtier inside a real vLLM engine on a short multi-turn chat workload."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from kvtier.cli import args as argtypes
from kvtier.cli.common import JSON
from kvtier.demo import DEFAULT_CONFIG, MAX_TURNS, DemoResult, run_demo
from kvtier.status import StatusLine, elapsed
from tiering.config import load_config

__all__ = ["add_parser", "run", "table"]


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "demo",
        parents=[JSON],
        help="run a real vLLM engine with kvtier on a multi-turn chat workload",
        description=(
            "Run vLLM 0.32 (CPU build, in its own virtual environment, prepared on first use) "
            "with kvtier on a short multi-turn chat workload, and print each turn's time to "
            "first token without kvtier, with it and after a warm restart, and where the "
            "prompt tokens came from: the engine's own prefix cache, kvtier, or recomputation. "
            "Progress goes to standard error."
        ),
    )
    parser.add_argument(
        "--config",
        type=argtypes.path,
        default=DEFAULT_CONFIG,
        help="kvtier YAML file (default: the demo's own, a file tier in a temporary directory)",
    )
    parser.add_argument(
        "--conversations",
        type=argtypes.count(1, 100),
        default=4,
        help="chats sharing a system prompt (default 4)",
    )
    parser.add_argument(
        "--turns",
        type=argtypes.count(1, MAX_TURNS),
        default=4,
        help=f"turns of each chat (default 4; at most {MAX_TURNS}, the model's positions)",
    )
    parser.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="first run without kvtier, and compare (the default; --no-compare skips it)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-nvme-") as disk:
        os.environ.setdefault("KVTIER_DEMO_DIR", disk)  # the demo config's file tier
        load_config(args.config)  # a bad file fails here, before minutes of engine start-up
        status = StatusLine("kvtier demo")
        began = time.monotonic()

        def progress(text: str) -> None:
            status.show(text, elapsed(time.monotonic() - began))

        try:
            results = run_demo(
                args.config, args.conversations, args.turns, args.compare, progress=progress
            )
        finally:
            status.close()
    if args.json:
        report = {name: asdict(r) for name, r in results.items()}
        for r in report.values():
            del r["outputs"]
        report["identical_outputs"] = _identical(results)  # type: ignore[assignment]
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"kvtier demo: {args.conversations} conversations x {args.turns} turns, {args.config}; "
        "then the same chats in a restarted engine on the same file tier"
    )
    print("\n".join(table(results)))
    return 0


def table(results: dict[str, DemoResult]) -> list[str]:
    """The demo's figures, one column per run: each turn's mean time to first token, then
    where the prompt tokens came from, bytes moved and time spent."""
    turns = len(next(iter(results.values())).ttft)
    rows: list[tuple[str, Callable[[DemoResult], str]]] = [
        ("time to first token (mean)", lambda r: ""),
        *(
            (f"  turn {turn + 1}", lambda r, turn=turn: f"{r.mean_ttft(turn):.2f} s")
            for turn in range(turns)
        ),
        ("requests", lambda r: f"{r.requests:,}"),
        ("prompt tokens", lambda r: f"{r.prompt_tokens:,}"),
        ("from the engine's prefix cache", lambda r: f"{r.engine_cached_tokens:,}"),
        ("from kvtier", lambda r: f"{r.kvtier_tokens:,}"),
        ("  of which from the file tier", lambda r: f"{32 * r.tier_blocks:,}"),
        ("recomputed", lambda r: f"{r.recomputed_tokens:,}"),
        ("bytes loaded from kvtier", lambda r: f"{r.bytes_loaded:,}"),
        ("bytes stored to kvtier", lambda r: f"{r.bytes_stored:,}"),
        ("time copying blocks", lambda r: f"{1e3 * r.copy_seconds:.1f} ms"),
        ("time for the workload", lambda r: f"{r.seconds:.1f} s"),
    ]
    width = max(len(label) for label, _ in rows)
    lines = ["  ".join([" " * width, *(name.rjust(12) for name in results)])]
    for label, cell in rows:
        cells = (cell(r).rjust(12) for r in results.values())
        lines.append("  ".join([label.ljust(width), *cells]).rstrip())
    lines.append("identical outputs: " + ("yes" if _identical(results) else "NO"))
    return lines


def _identical(results: dict[str, Any]) -> bool:
    outputs = [r.outputs for r in results.values()]
    return all(o == outputs[0] for o in outputs)
