"""bench/ttft.py's set-ups and its report: per set-up, medians over rounds of the time to first
token of the return and of the ratios taken per round (to recomputing, to the engine hit, to the
limit, to the primary's return), of each engine process's first request against vLLM alone's,
promotion throughput against the raw bandwidth, and the table printed from them; what
bench/ttft.py and bench/fleet.py share (the machine, the progress line)."""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Setup:
    title: str
    source: str | None
    """The metric the return's cached tokens must all be counted in (None: vLLM alone)."""
    warm: bool
    """A warm restart: a second engine process finds the prompt in a tier."""
    medium: str | None
    """Where the return's KV comes from, whose raw bandwidth makes the limit."""
    warm_start: bool = False
    """The second engine reads the tier's blocks into its primary at start
    (`primary.warm_start`): the return finds them there, off the request's path."""


SETUPS = {
    "vllm": Setup("vLLM alone (recompute)", None, False, None),
    "primary": Setup("kvtier primary", "host_cached_tokens", False, "host memory"),
    "file": Setup("warm restart: file (files)", "disk_cached_tokens", True, "disk"),
    "file/segments": Setup("warm restart: file (segments)", "disk_cached_tokens", True, "disk"),
    "file/warm-start": Setup(
        "warm restart: file (files), warm start", "host_cached_tokens", True, "disk", True
    ),
    "redis": Setup("warm restart: redis", "remote_cached_tokens", True, "redis"),
    "s3": Setup("warm restart: s3", "remote_cached_tokens", True, "s3"),
}
"""The set-ups by their `--setups` names, in the first round's order."""


def summarize(rounds: list[dict[str, Any]], kv_bytes: int) -> list[dict[str, Any]]:
    """One row per set-up (and one for the engine hit): medians over rounds of the time to
    first token and of the per-round ratios."""

    def med(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    rows = []
    hit = [r["engine_hit"]["seconds"] for r in rounds]
    recompute = [r["setups"]["vllm"]["seconds"] for r in rounds]
    alone_first = [r["setups"]["vllm"]["first"] for r in rounds]
    rows.append(
        {
            "setup": "engine hit",
            "title": "prompt in the engine's own cache",
            "ttft": med(hit),
            "ttft_min": min(hit),
            "ttft_max": max(hit),
            "vs_recompute": med([h / c for h, c in zip(hit, recompute, strict=True)]),
            "cached_tokens": rounds[0]["engine_hit"]["cached_tokens"][0],
        }
    )
    for name in rounds[0]["setups"]:
        got = [r["setups"][name] for r in rounds]
        ttft = [g["seconds"] for g in got]
        row: dict[str, Any] = {
            "setup": name,
            "title": SETUPS[name].title,
            "ttft": med(ttft),
            "ttft_min": min(ttft),
            "ttft_max": max(ttft),
            "vs_recompute": med([t / c for t, c in zip(ttft, recompute, strict=True)]),
            "cached_tokens": got[0]["cached_tokens"],
            "source": SETUPS[name].source,
        }
        first = [g["first"] for g in got]
        row |= {
            "first": med(first),
            "first_min": min(first),
            "first_max": max(first),
            "first_vs_vllm": med([f / a for f, a in zip(first, alone_first, strict=True)]),
        }
        row["vs_hit"] = med([t / h for t, h in zip(ttft, hit, strict=True)])
        if "primary" in rounds[0]["setups"]:
            primary = [r["setups"]["primary"]["seconds"] for r in rounds]
            row["vs_primary"] = med([t / p for t, p in zip(ttft, primary, strict=True)])
        if SETUPS[name].medium is not None:
            raw = [media_rate(r["bandwidth"][name]) for r in rounds]
            limits = [kv_bytes / b + h for b, h in zip(raw, hit, strict=True)]
            row |= {
                "medium": SETUPS[name].medium,
                "raw_gib_s": med([b / 2**30 for b in raw]),
                "raw_method": rounds[0]["bandwidth"][name]["method"],
                "limit": med(limits),
                "vs_limit": med([t / lim for t, lim in zip(ttft, limits, strict=True)]),
            }
        if SETUPS[name].warm:
            rates = [
                g["metrics"].get("bytes_promoted", 0) / g["metrics"]["promotion_seconds"]
                for g in got
                if g["metrics"].get("promotion_seconds")
            ]
            if len(rates) == len(got):
                row["promotion_gib_s"] = med([p / 2**30 for p in rates])
                row["promotion_vs_raw"] = med(
                    [
                        p / media_rate(r["bandwidth"][name])
                        for p, r in zip(rates, rounds, strict=True)
                    ]
                )
        rows.append(row)
    return rows


def media_rate(bandwidth: dict[str, Any]) -> float:
    """Bytes per second of a `media.Bandwidth.as_dict()`."""
    return float(bandwidth["bytes"]) / float(bandwidth["seconds"])


def print_table(report: dict[str, Any]) -> None:
    w = report["workload"]
    print(
        f"time to first token of a {w['prompt_tokens']}-token return ({w['kv_bytes'] >> 10} KiB "
        f"of KV), median of {report['rounds']} round(s) (min-max); ratios: median per round"
    )
    head = (
        "set-up",
        "TTFT s",
        "x recompute",
        "x hit",
        "limit s",
        "x limit",
        "x primary",
        "promotion GiB/s",
        "first request s",
        "x vLLM's first",
    )
    lines = [head]
    for r in report["rows"]:

        def fmt(key: str, spec: str = ".2f", r: dict[str, Any] = r) -> str:
            return "-" if r.get(key) is None else format(r[key], spec)

        promotion = "-"
        if r.get("promotion_gib_s") is not None:
            promotion = (
                f"{r['promotion_gib_s']:.3g} of {r['raw_gib_s']:.3g} raw "
                f"= {r['promotion_vs_raw']:.2f}"
            )
        lines.append(
            (
                r["title"],
                f"{r['ttft']:.3f} ({r['ttft_min']:.3f}-{r['ttft_max']:.3f})",
                fmt("vs_recompute", ".3f"),
                fmt("vs_hit"),
                fmt("limit", ".3f"),
                fmt("vs_limit"),
                fmt("vs_primary"),
                promotion,
                "-" if r.get("first") is None else first_request(r),
                fmt("first_vs_vllm"),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)))
    print("limits: the KV bytes over the medium's raw read bandwidth + the engine hit's TTFT")
    for r in report["rows"]:
        if "medium" in r:
            print(f"  {r['title']}: {r['medium']} {r['raw_gib_s']:.3g} GiB/s ({r['raw_method']})")


def first_request(row: dict[str, Any]) -> str:
    return f"{row['first']:.3f} ({row['first_min']:.3f}-{row['first_max']:.3f})"


def machine() -> dict[str, Any]:
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version()}


class Progress:
    """A line on stderr per phase of a benchmark, with the time since its start: a full run
    takes minutes."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def say(self, what: str) -> None:
        print(f"[{time.monotonic() - self.start:6.0f} s] {what}", file=sys.stderr, flush=True)
