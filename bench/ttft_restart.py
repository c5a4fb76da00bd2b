"""bench/ttft.py's restart set-up (`--restart`, issue 33 item 5): a restarted engine's return of
its hot prompt, read back by the warm start that follows its last manifest of use, against a
primary hit in the same engine process.

A first engine (the fill), with every selected tier written through and a primary of
`primary_bytes`, sends a hot prompt first, then other prompts, the hot one returning after every
second of them, until each tier holds at least 4x the primary. It settles after each prompt
(`settle_each`: its stores and write-through demotions end before the next prompt), as a
server's gaps between requests let them: sent back to back, a prompt's demotions found the last
ones still in flight when the disk was busy, and past the tier's `max_inflight` they were
dropped (`demotions_dropped`, the tier's back-pressure: 111 of 873 blocks under a concurrent
`dd`, none with `settle_each`), and the tier held 3.3-4.0x the primary. It then shuts down (its
manifest of use is written at shutdown). The hot
prompt was written first: by write time it is the tiers' oldest. Then, per set-up, a second
engine process with that tier alone and `primary.warm_start` of the whole primary serves an
unrelated prompt (its first request), the hot prompt (*the return*), an unrelated prompt that
needs every engine block, and the hot prompt again (*the primary hit*: from the primary,
in the same process). The figure is the return's time over the primary hit's. The engine
settles after each prompt (`settle_each`), as vLLM's own engine process steps between
requests: without it the in-process engine makes the evictor's store jobs in the hit's first
step, and the hit's time held them (a hit 1.5-4x slower than the return, the S3 one 0.41 s).

Set-ups: `file`, `file/segments`, `redis`, `s3` (the fill's tiers); `kill`: a fill of its own
onto a files directory, its manifest written every `KILL_INTERVAL` s, killed with SIGKILL
`KILL_AFTER` s after its last prompt (no shutdown: the second engine follows the last periodic
manifest); `file/newest`: a copy of the fill's files directory without its manifest, so the
warm start reads the tiers' newest (what a restart did before the manifest).

Checked, and the command fails when one does not hold: each tier holds at least 4x the primary
after the fill (the report gives each fill's dropped demotions); the return and the hit find
the whole prompt cached, with the same first token; with the manifest, the warm start followed
it and the hit came from the primary (`host`; the return too when the warm start read it before
it came: `host_tokens` says how many).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.ttft_report import Progress

if TYPE_CHECKING:
    from bench.ttft import Bench, Workload

RESTART_SETUPS = ("file", "file/segments", "redis", "s3", "kill", "file/newest")
MARGIN = 1.2
"""The primary: the hot prompt, the unrelated ones and this margin (the full workload: 159 MiB,
about the issue's 160 MiB)."""
KILL_INTERVAL = 2.0
KILL_AFTER = 6.0


def primary_bytes(w: Workload) -> int:
    """The primary's bytes: what one restarted engine's prompts need, and `MARGIN`, in KiB."""
    tokens = w.prompt_tokens + w.evictor_tokens + w.warmup_tokens
    return -(-int(MARGIN * tokens * w.kv_bytes_per_token) // 1024) * 1024


def others(w: Workload) -> int:
    """Other prompts of the fill: with the hot one, at least 4x the primary."""
    return -(-4 * primary_bytes(w) // w.kv_bytes)


def fill_order(hot: list[int], others: list[list[int]]) -> list[list[int]]:
    """The hot prompt first, then the others, the hot one again after every second of them."""
    order = [hot]
    for i, other in enumerate(others):
        order.append(other)
        if i % 2 == 1:
            order.append(hot)
    return order


class Restart:
    """The benchmark process: the restart set-up's rounds on `bench`'s engines and servers."""

    def __init__(self, bench: Bench, setups: list[str]) -> None:
        self.bench, self.setups = bench, setups

    def tier(self, name: str, round_: int) -> dict[str, Any]:
        base = "file" if name in ("kill", "file/newest") else name
        tier = dict(self.bench.tier(base, 100 + round_))  # storage apart from the other set-ups'
        if name != base:
            tier["path"] = str(Path(tier["path"]).with_name(name.replace("/", "-")))
            tier["name"] = "nvme-" + name.replace("/", "-")
        return tier

    def round(self, round_: int, progress: Progress) -> dict[str, Any]:
        from bench.ttft import ENGINE_BLOCK, flush, rotated, stored_blocks, tokens

        bench, w = self.bench, self.bench.workload
        hot = tokens(f"restart-hot-{round_}", w.prompt_tokens)
        more = [tokens(f"restart-other-{round_}-{i}", w.prompt_tokens) for i in range(others(w))]
        evictor = tokens(f"restart-evictor-{round_}", w.evictor_tokens)
        size = primary_bytes(w)
        primary = {"capacity": f"{size // 1024}KiB"}
        record: dict[str, Any] = {"setups": {}, "held": {}, "problems": []}
        problems: list[str] = record["problems"]
        filled = [n for n in self.setups if n not in ("kill", "file/newest")]
        if "file/newest" in self.setups and "file" not in filled:
            filled.append("file")
        tiers = {name: self.tier(name, round_) for name in filled}
        if bench.redis is not None:
            flush(bench.redis.url)
        progress.say(f"restart round {round_ + 1}: fill of {', '.join(filled)}")
        fill = fill_order(hot, more)
        dropped = record["dropped"] = {}  # set-up -> its fill's dropped demotions, all tiers
        if filled:
            result = bench.engine(
                fill, list(tiers.values()), True, size, primary=primary, settle_each=True
            )
            dropped.update(dict.fromkeys(filled, result["metrics"].get("demotions_dropped", 0)))
        if "kill" in self.setups:
            progress.say(f"restart round {round_ + 1}: fill, then kill -9")
            tiers["kill"] = self.tier("kill", round_)
            result = bench.engine(
                fill,
                [tiers["kill"]],
                True,
                size,
                primary={**primary, "warm_manifest_interval": KILL_INTERVAL},
                settle_each=True,
                kill_after=KILL_AFTER,
            )
            dropped["kill"] = result["metrics"].get("demotions_dropped", 0)
        if "file/newest" in self.setups:
            tiers["file/newest"] = self.tier("file/newest", round_)
            shutil.copytree(tiers["file"]["path"], tiers["file/newest"]["path"])
            shutil.rmtree(Path(tiers["file/newest"]["path"]) / ".kvtier" / "records")
        for name, tier in tiers.items():
            held = stored_blocks(tier) * ENGINE_BLOCK * w.kv_bytes_per_token
            record["held"][name] = held / size
            if held < 4 * size:
                problems.append(
                    f"restart round {round_ + 1}, {name}: the tier holds "
                    f"{held / size:.1f}x the primary, not 4x"
                    f" ({dropped.get(name, 0):g} demotions dropped in the fill)"
                )
        for name in rotated(self.setups, round_):
            progress.say(f"restart round {round_ + 1}: {name}")
            warmup = tokens(f"restart-warmup-{round_}-{name}", w.warmup_tokens)
            result = bench.engine(
                [warmup, hot, evictor, hot],
                [tiers[name]],
                False,
                size,
                primary=primary,
                settle_each=True,
            )
            first, back, _, hit = result["outputs"]
            got = {
                "first": first["seconds"],
                "return": back["seconds"],
                "hit": hit["seconds"],
                "ratio": back["seconds"] / hit["seconds"],
                "cached_tokens": [back["cached_tokens"], hit["cached_tokens"]],
                "metrics": {k: v for k, v in result["metrics"].items() if v},
                "host_tokens": result["metrics"].get("host_cached_tokens", 0),
                "followed": "following the last run's manifest of use" in result["log"],
            }
            record["setups"][name] = got
            problems += check(round_, name, got, back, hit, w.prompt_tokens)
        return record


def check(
    round_: int, name: str, got: dict[str, Any], back: Any, hit: Any, prompt: int
) -> list[str]:
    where = f"restart round {round_ + 1}, {name}"
    problems = []
    if back["tokens"] != hit["tokens"]:
        problems.append(f"{where}: the return's first token differs from the hit's")
    if hit["cached_tokens"] < prompt - 32 or back["cached_tokens"] != hit["cached_tokens"]:
        problems.append(f"{where}: cached tokens {got['cached_tokens']}")
    if name != "file/newest":
        if not got["followed"]:
            problems.append(f"{where}: the warm start did not follow a manifest")
        host = got["metrics"].get("host_cached_tokens", 0)
        if host < hit["cached_tokens"]:
            problems.append(f"{where}: {host:g} tokens from the primary, not the hit's")
    return problems


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for name in records[0]["setups"]:
        got = [r["setups"][name] for r in records]
        ratios = [g["ratio"] for g in got]
        rows.append(
            {
                "setup": name,
                "ratio": statistics.median(ratios),
                "ratios": ratios,
                "return": statistics.median(g["return"] for g in got),
                "hit": statistics.median(g["hit"] for g in got),
                "held": statistics.median(r["held"][name] for r in records),
                "dropped": sum(r["dropped"].get(name, 0) for r in records),
            }
        )
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"{'set-up':<14} {'return / hit':>13}  rounds            return s  hit s  tier/primary")
    for r in rows:
        spread = "/".join(f"{x:.2f}" for x in r["ratios"])
        print(
            f"{r['setup']:<14} {r['ratio']:>12.2f}x  {spread:<17} {r['return']:>8.3f}"
            f"  {r['hit']:.3f}  {r['held']:.1f}x",
            file=sys.stdout,
        )


def main(args: argparse.Namespace) -> int:
    """`--restart`: the restart set-up's rounds (bench/ttft_restart.py), its own report."""
    from bench.ttft import run_rounds

    setups = [s for s in args.restart.split(",") if s]
    if not setups or any(s not in RESTART_SETUPS for s in setups):
        raise SystemExit(f"--restart: set-ups of {', '.join(RESTART_SETUPS)}")
    records, head = run_rounds(
        args, setups, lambda bench: Restart(bench, setups).round, "kvtier-restart-"
    )
    problems = [p for r in records for p in r["problems"]]
    report = {
        **head,
        "rounds": len(records),
        "rows": summarize(records),
        "per_round": records,
        "problems": problems,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_rows(report["rows"])
        print(f"wall time {report['wall_seconds']:.0f} s, {report['date']}")
    for problem in problems:
        print(f"ttft: {problem}", file=sys.stderr)
    return 1 if problems else 0
