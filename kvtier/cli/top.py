"""`kvtier top`: a live view of running engines' kvtier metrics (`kvtier.top`), drawn with
curses, refreshed every `--interval` seconds, `q` quits; `--once` prints one reading."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from kvtier.cli.common import JSON
from kvtier.top import Endpoint, lines, read_all, tier_rows
from tiering.errors import ConfigError

__all__ = ["add_parser", "run"]

MIN_INTERVAL = 0.2
MAX_ENDPOINTS = 64


def add_parser(commands: Any) -> None:
    parser: argparse.ArgumentParser = commands.add_parser(
        "top",
        parents=[JSON],
        help="a live view of running engines from their metrics endpoints",
        description=(
            "Read running engines' metrics endpoints (vLLM's /metrics) every --interval seconds "
            "and show, per engine, the primary's use, late promotions and the warm start, and "
            "per tier: hits and misses per second, bytes per second in (promoted into the "
            "engine) and out (demoted to the tier), objects and bytes used against capacity, "
            "and the circuit breaker. An endpoint that does not answer is shown down and read "
            "again. q quits."
        ),
    )
    parser.add_argument(
        "--metrics",
        nargs="+",
        required=True,
        metavar="URL",
        help="metrics endpoints, e.g. http://localhost:8000/metrics",
    )
    parser.add_argument(
        "--interval", type=float, default=1.0, help="seconds between refreshes (default 1)"
    )
    parser.add_argument(
        "--once",
        action="store_true",
        help="read every endpoint twice, --interval apart, print what top would show and exit "
        "(with --json: as data)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not args.interval >= MIN_INTERVAL or args.interval > 3600:
        raise ConfigError(f"--interval: {MIN_INTERVAL} to 3600 seconds, not {args.interval}")
    if len(args.metrics) > MAX_ENDPOINTS:
        raise ConfigError(f"--metrics: at most {MAX_ENDPOINTS} endpoints")
    for url in args.metrics:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--metrics {url!r}: an http:// or https:// URL")
    endpoints = [Endpoint(url) for url in args.metrics]
    timeout = min(args.interval, 2.0)
    if args.once or args.json:
        read_all(endpoints, timeout)
        time.sleep(args.interval)
        read_all(endpoints, timeout)
        if args.json:
            print(json.dumps([_as_json(e) for e in endpoints], indent=2))
        else:
            print("\n".join(lines(endpoints, 200, time.strftime("%H:%M:%S"))))
        return 0 if all(e.now.down is None for e in endpoints) else 1
    import curses

    return int(curses.wrapper(_live, endpoints, args.interval, timeout))


def _live(screen: Any, endpoints: list[Endpoint], interval: float, timeout: float) -> int:
    import curses

    curses.curs_set(0)
    screen.timeout(100)  # getch waits at most 0.1 s: keys are seen while waiting to refresh
    due = 0.0
    while True:
        now = time.monotonic()
        if now >= due:
            read_all(endpoints, timeout)
            due = now + interval
            height, width = screen.getmaxyx()
            screen.erase()
            for y, text in enumerate(
                lines(endpoints, max(width - 1, 1), time.strftime("%H:%M:%S"))
            ):
                if y >= height:
                    break
                screen.addstr(y, 0, text)
            screen.refresh()
        key = screen.getch()
        if key in (ord("q"), ord("Q")):
            return 0
        if key == curses.KEY_RESIZE:
            due = 0.0


def _as_json(e: Endpoint) -> dict[str, Any]:
    return {
        "url": e.url,
        "down": e.now.down,
        "tiers": [
            {
                "tier": r.tier,
                "hits_per_s": r.hits,
                "misses_per_s": r.misses,
                "bytes_in_per_s": r.bytes_in,
                "bytes_out_per_s": r.bytes_out,
                "objects": r.objects,
                "used_bytes": r.used,
                "capacity_bytes": r.capacity,
                "breaker_open": r.breaker_open,
            }
            for r in tier_rows(e)
        ],
    }
