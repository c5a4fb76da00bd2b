"""A fleet of K real vLLM engines (CPU build) on one store under a concurrent multi-round chat
workload: time to first token and throughput of each engine against the same engine alone, in
one command.

The workload is `kvtier.chat_fleet`'s: `K x --conversations-per-engine` conversations of `--turns`
turns, turn t of conversation c served by engine (c + t) mod K, so a returning turn's prefix
was stored by another engine (with more turns than engines, some by the engine itself). Each
round runs

- the fleet: the K engines at once, one process each, on a fresh location of the store (a
  flushed Redis, a new S3 prefix, a new directory), handing the conversations to one another;
- each engine alone: one engine process with the same kvtier config, on a fresh location of
  the store, nothing else running, serving the same prompts in the same order as that engine
  did in the fleet (its returning turns find nothing of the earlier turns: no other engine
  stored them).

With `--unshared`, also the fleet unshared: the K engines at once as in the fleet, each on a
location of the store of its own (another Redis database, S3 prefix or directory): the same
contention for the CPU and the store, nothing shared. Fleet against unshared is then what
sharing gives under equal contention; unshared against alone what the contention costs.

Rounds alternate the order of the runs (the first round's fleet gives the prompts). Per
engine: the median time to first token of its first turns (nothing to share: in the fleet,
other engines compete for the CPU and the store) and of its returning turns (shared prefixes
come from the store), its throughput (prompt and answer tokens per second of its requests'
time), each as a ratio to the engine alone (and to the unshared fleet) per round, then their
median over rounds; and the fleet's tokens per second over the time from its first request to
its last, against the engines alone one after another. Checked, and the command fails when one
does not hold: every turn's tokens, in every run, equal, and their logprobs within
`LOGPROB_TOLERANCE` (KV loaded from another engine's blocks gives what recomputing gives).

    python bench/fleet.py [--engines 3] [--medium redis|redis-cluster|s3|files]
                          [--blocks-per-object N] [--unshared] [--rounds 1]
                          [--conversations-per-engine 2] [--turns 3] [--dir DIR]
                          [--model-dir DIR] [--smoke] [--json]

`--smoke`: the 2-layer Llama of connectors/vllm/run.py, one conversation per engine, short
prompts, one round (CI). Otherwise the demo's 8-layer Llama and 1,024-token first messages.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.ttft_report import Progress, machine  # noqa: E402
from kvtier.chat_fleet import (  # noqa: E402
    ChatWorkload,
    FleetRun,
    Store,
    differences,
    files_store,
    logprob_deviation,
    prompts_of,
    redis_store,
    run_alone,
    run_fleet,
    s3_store,
)
from kvtier.demo import MODEL as DEMO_MODEL  # noqa: E402
from kvtier.servers import RedisClusterServers, RedisServer, SeaweedS3  # noqa: E402

MEDIA = ("redis", "redis-cluster", "s3", "files")
CAPACITY = "4GiB"
"""The shared tier's capacity: above what any run here stores."""
TIMEOUT = 1800.0

FULL = ChatWorkload(
    first_tokens=1024,
    message_tokens=128,
    answer_tokens=32,
    warmup_tokens=64,
    engine_blocks=66,
    max_model_len=2048,
    primary_capacity="512MiB",
    model=dict(DEMO_MODEL),
)
SMOKE = ChatWorkload(conversations_per_engine=1)
LOGPROB_TOLERANCE = 1e-4
"""How far a logprob of the full workload's model may be from another run's for the same
tokens (its prefill's sums, cut elsewhere by a cached prefix, differ in their last bits: about
3e-6 seen); the smoke run's 2-layer Llama gives the same bits (`kvtier.chat_fleet.differences`)."""


class Bench:
    """The benchmark process: owns the scratch directory, the store's server and the engines
    (vLLM's environment, through `kvtier.chat_fleet`)."""

    def __init__(
        self,
        workload: ChatWorkload,
        medium: str,
        blocks_per_object: int,
        unshared: bool,
        python: Path,
        scratch: Path,
        model_dir: Path,
    ) -> None:
        self.workload, self.medium, self.python = workload, medium, python
        self.blocks_per_object = blocks_per_object
        self.scratch, self.model_dir = scratch, model_dir
        self.server: RedisServer | RedisClusterServers | SeaweedS3 | None = None
        self.runs = 0
        self.prompts: dict[tuple[int, int], list[int]] | None = None
        self.unshared = unshared
        self.tolerance = LOGPROB_TOLERANCE if workload.model is not None else 0.0

    def start_server(self) -> None:
        if self.medium == "redis":
            self.server = RedisServer(self.scratch / "redis")
        elif self.medium == "redis-cluster":
            self.server = RedisClusterServers(self.scratch / "redis-cluster")
        elif self.medium == "s3":
            self.server = SeaweedS3(self.scratch / "seaweedfs")
        if self.server is not None:
            self.server.start()

    def stop_server(self) -> None:
        if self.server is not None:
            self.server.stop()

    def fresh(self, own: bool = False) -> tuple[list[Store], Path]:
        """A fresh location of the store (`own`: one per engine), and a fresh directory for
        the engines' files."""
        self.runs += 1
        workdir = self.scratch / f"run-{self.runs}"
        workdir.mkdir()
        count = self.workload.engines if own else 1
        server = self.server
        if isinstance(server, RedisClusterServers):
            for node in server.nodes:
                flush(node.port)
            return [redis_store(server.url, cluster=True, capacity=CAPACITY)], workdir
        if isinstance(server, RedisServer):
            flush(server.port)
            url = server.url.rsplit("/", 1)[0]
            return [redis_store(f"{url}/{i}", capacity=CAPACITY) for i in range(count)], workdir
        if isinstance(server, SeaweedS3):
            return [
                s3_store(
                    server.endpoint,
                    server.bucket,
                    f"fleet-{uuid.uuid4().hex}/",
                    server.ACCESS_KEY,
                    server.SECRET_KEY,
                    blocks_per_object=self.blocks_per_object,
                    capacity=CAPACITY,
                )
                for _ in range(count)
            ], workdir
        return [
            files_store(workdir / f"store-{i}", capacity=CAPACITY) for i in range(count)
        ], workdir

    def fleet(self, progress: Progress, own: bool = False) -> FleetRun:
        stores, workdir = self.fresh(own)
        what = "each on its own store" if own else "on one store"
        progress.say(f"fleet of {self.workload.engines} engines, {what} ({self.medium})")
        store = stores if own else stores[0]
        return run_fleet(self.python, self.workload, store, self.model_dir, workdir, TIMEOUT)

    def alone(
        self, engine: int, prompts: dict[tuple[int, int], list[int]], progress: Progress
    ) -> dict[str, Any]:
        (store,), workdir = self.fresh()
        progress.say(f"engine {engine} alone ({self.medium})")
        return run_alone(
            self.python, self.workload, engine, prompts, store, self.model_dir, workdir, TIMEOUT
        )

    def round(self, round_: int, progress: Progress) -> dict[str, Any]:
        """The fleet, the unshared fleet (with `unshared`) and each engine alone; in odd
        rounds in the reverse order, on the prompts of the first round's fleet (the fleet's
        answers make the prompts of its later turns)."""
        runs: dict[str, Any] = {}
        phases = ["fleet", *(["unshared"] if self.unshared else []), "alone"]
        if self.prompts is not None and round_ % 2 == 1:
            phases.reverse()
        for phase in phases:
            if phase == "alone":
                assert self.prompts is not None
                runs[phase] = [
                    self.alone(e, self.prompts, progress) for e in range(self.workload.engines)
                ]
                continue
            runs[phase] = self.fleet(progress, own=phase == "unshared")
            if self.prompts is None:
                answers = {turn: out["tokens"] for turn, out in runs[phase].turns.items()}
                self.prompts = prompts_of(self.workload, answers)
        return record(self.workload, round_, runs, self.tolerance)


def flush(port: int) -> None:
    """Empty one of the benchmark's own Redis servers."""
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    try:
        client.flushall()
    finally:
        client.close()


def record(
    workload: ChatWorkload, round_: int, runs: dict[str, Any], tolerance: float
) -> dict[str, Any]:
    """A round's figures per engine (`runs`: the `fleet` and `unshared` `FleetRun`s, the
    results of each engine `alone`), and what did not hold."""
    schedule = workload.schedule()
    alone: list[dict[str, Any]] = runs["alone"]
    turns: dict[str, dict[tuple[int, int], dict[str, Any]]] = {}
    for name, run in runs.items():
        turns[name] = run.turns if isinstance(run, FleetRun) else {}
    for engine, result in enumerate(alone):
        labelled(result["outputs"], schedule[engine])
        for out in result["outputs"]:
            turns["alone"][out["conversation"], out["turn"]] = out
    problems = []
    deviation = 0.0
    for name in turns:
        if name != "fleet":
            found = differences(turns[name], turns["fleet"], tolerance)
            problems += [f"round {round_ + 1}, {name} against the fleet: {p}" for p in found]
            deviation = max(
                [deviation]
                + [
                    logprob_deviation(out, turns["fleet"][turn])
                    for turn, out in turns[name].items()
                    if turn in turns["fleet"] and out["tokens"] == turns["fleet"][turn]["tokens"]
                ]
            )
    engines = []
    for engine in range(workload.engines):
        results = {
            name: run.engines[engine] if isinstance(run, FleetRun) else run[engine]
            for name, run in runs.items()
        }
        engines.append(
            {"engine": engine}
            | {name: figures(result["outputs"]) for name, result in results.items()}
            | {
                f"{name}_metrics": {k: v for k, v in result["metrics"].items() if v}
                for name, result in results.items()
            }
        )
    every = [o for r in runs["fleet"].engines for o in r["outputs"]]
    span = max(o["at"] + o["seconds"] for o in every) - min(o["at"] for o in every)
    tokens = sum(served(o) for o in every)
    alone_seconds = sum(o["seconds"] for r in alone for o in r["outputs"])
    return {
        "round": round_,
        "engines": engines,
        "fleet_span_seconds": span,
        "fleet_tokens_per_s": tokens / span,
        "alone_tokens_per_s": tokens / alone_seconds,
        "logprob_deviation": deviation,
        "problems": problems,
    }


def served(out: dict[str, Any]) -> int:
    """Tokens a request served: its prompt's and its answer's."""
    return int(out["prompt_tokens"]) + len(out["tokens"])


def figures(outputs: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's requests: median time to first token of its first and returning turns,
    tokens per second of request time, the returning turns' share of cached prompt tokens."""
    first = [o for o in outputs if o.get("turn", 0) == 0]
    back = [o for o in outputs if o not in first]
    return {
        "requests": len(outputs),
        "ttft_first": statistics.median(o["ttft"] for o in first) if first else None,
        "ttft_return": statistics.median(o["ttft"] for o in back) if back else None,
        "tokens_per_s": sum(served(o) for o in outputs) / sum(o["seconds"] for o in outputs),
        "return_cached_share": (
            sum(o["cached_tokens"] for o in back) / sum(o["prompt_tokens"] for o in back)
            if back
            else None
        ),
        "turns": [
            {
                k: o.get(k)
                for k in ("conversation", "turn", "prompt_tokens", "cached_tokens", "ttft")
            }
            for o in outputs
        ],
    }


def labelled(outputs: list[dict[str, Any]], turns: Sequence[tuple[int, int]]) -> None:
    """Give an alone run's outputs the turns they stand for (in place)."""
    for out, (c, t) in zip(outputs, turns, strict=True):
        out["conversation"], out["turn"] = c, t


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per engine, then for the fleet: medians over rounds of the figures and of the ratios
    taken per round (fleet / alone; with the unshared fleet, fleet / unshared and unshared /
    alone)."""

    def med(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else a / b

    pairs = [("fleet", "alone")]
    if "unshared" in records[0]["engines"][0]:
        pairs += [("fleet", "unshared"), ("unshared", "alone")]
    rows = []
    for engine in range(len(records[0]["engines"])):
        got = [r["engines"][engine] for r in records]
        row: dict[str, Any] = {"engine": engine}
        for key in ("ttft_first", "ttft_return", "tokens_per_s", "return_cached_share"):
            for name in {name for pair in pairs for name in pair}:
                row[f"{name}_{key}"] = med([g[name][key] for g in got])
            if key == "return_cached_share":
                continue
            for a, b in pairs:
                suffix = "" if (a, b) == ("fleet", "alone") else f"_{a}_vs_{b}"
                row[f"{key}_ratio{suffix}"] = med([ratio(g[a][key], g[b][key]) for g in got])
        row["promotions"] = med([g["fleet_metrics"].get("tier_promotions", 0) for g in got])
        rows.append(row)
    fleet = [r["fleet_tokens_per_s"] for r in records]
    alone = [r["alone_tokens_per_s"] for r in records]
    rows.append(
        {
            "engine": "fleet",
            "fleet_tokens_per_s": med(list(fleet)),
            "alone_tokens_per_s": med(list(alone)),
            "tokens_per_s_ratio": med([f / a for f, a in zip(fleet, alone, strict=True)]),
        }
    )
    return rows


def print_table(report: dict[str, Any]) -> None:
    w = report["workload"]
    print(
        f"{w['engines']} engines at once on {report['medium']} against each engine alone: "
        f"{w['engines'] * w['conversations_per_engine']} conversations x {w['turns']} turns "
        f"(first message {w['first_tokens']} tokens, then {w['message_tokens']}, answers "
        f"{w['answer_tokens']}), median of {report['rounds']} round(s); ratios fleet / alone, "
        "median per round"
    )
    unshared = "unshared_ttft_first" in report["rows"][0]
    head = (
        "engine",
        "TTFT first s (x alone)",
        "TTFT return s (x alone" + (", x unshared)" if unshared else ")"),
        "tokens/s (x alone" + (", x unshared)" if unshared else ")"),
        "return cached (alone" + (", unshared)" if unshared else ")"),
        "promotions",
    )
    lines = [head]

    def cell(r: dict[str, Any], key: str, spec: str, first: bool = False) -> str:
        if r.get(f"fleet_{key}") is None:
            return "-"
        text = f"{format(r[f'fleet_{key}'], spec)} ({r[f'{key}_ratio']:.2f}x"
        if unshared and not first and r.get(f"{key}_ratio_fleet_vs_unshared") is not None:
            text += f", {r[f'{key}_ratio_fleet_vs_unshared']:.2f}x"
        return text + ")"

    def share(r: dict[str, Any]) -> str:
        if r.get("fleet_return_cached_share") is None:
            return "-"
        others = [r["alone_return_cached_share"]]
        if unshared:
            others.append(r["unshared_return_cached_share"])
        return f"{r['fleet_return_cached_share']:.0%} ({', '.join(f'{o:.0%}' for o in others)})"

    for r in report["rows"]:
        lines.append(
            (
                str(r["engine"]),
                cell(r, "ttft_first", ".3f", first=True),
                cell(r, "ttft_return", ".3f"),
                cell(r, "tokens_per_s", ".0f"),
                share(r),
                "-" if r.get("promotions") is None else f"{r['promotions']:.0f}",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=3, help="engines at once (default 3)")
    parser.add_argument("--medium", choices=MEDIA, default="redis", help="the shared store")
    parser.add_argument(
        "--blocks-per-object", type=int, default=1, help="S3: blocks per pack (default 1)"
    )
    parser.add_argument(
        "--unshared",
        action="store_true",
        help="also the fleet with each engine on a store of its own (not redis-cluster)",
    )
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--conversations-per-engine", type=int, default=None)
    parser.add_argument("--turns", type=int, default=None, help="default 3")
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (a real disk)")
    parser.add_argument("--model-dir", type=Path, default=None, help="keep the model here")
    parser.add_argument("--vllm-python", type=Path, default=None, help="vLLM environment's python")
    parser.add_argument("--smoke", action="store_true", help="tiny model, short prompts (CI)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.engines < 1 or args.rounds < 1 or args.blocks_per_object < 1:
        parser.error("--engines, --rounds and --blocks-per-object are at least 1")
    if args.blocks_per_object > 1 and args.medium != "s3":
        parser.error("--blocks-per-object: only the s3 medium has packs")
    if args.unshared and args.medium == "redis-cluster":
        parser.error("--unshared: a Redis Cluster has one database, and the tier no key prefix")
    changes: dict[str, Any] = {"engines": args.engines}
    if args.conversations_per_engine is not None:
        changes["conversations_per_engine"] = args.conversations_per_engine
    if args.turns is not None:
        changes["turns"] = args.turns
    try:
        workload = dataclasses.replace(SMOKE if args.smoke else FULL, **changes)
    except ValueError as e:
        parser.error(str(e))
    if args.vllm_python is None:
        from kvtier.venv import ensure_vllm_venv

        args.vllm_python = ensure_vllm_venv()
    scratch = Path(tempfile.mkdtemp(prefix="kvtier-fleet-", dir=args.dir))
    model_dir = args.model_dir or scratch / "model"
    bench = Bench(
        workload,
        args.medium,
        args.blocks_per_object,
        args.unshared,
        args.vllm_python,
        scratch,
        model_dir,
    )
    progress = Progress()
    started, load = time.time(), os.getloadavg()
    records: list[dict[str, Any]] = []
    try:
        bench.start_server()
        records = [bench.round(r, progress) for r in range(args.rounds)]
    finally:
        bench.stop_server()
        shutil.rmtree(scratch, ignore_errors=True)
    problems = [p for r in records for p in r["problems"]]
    medium = args.medium
    if args.medium == "s3" and args.blocks_per_object > 1:
        medium = f"s3 ({args.blocks_per_object} blocks per object)"
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "machine": {**machine(), "load_before": load, "load_after": os.getloadavg()},
        "wall_seconds": time.time() - started,
        "medium": medium,
        "workload": dataclasses.asdict(workload),
        "rounds": args.rounds,
        "rows": summarize(records),
        "per_round": records,
        "problems": problems,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
        fleet = report["rows"][-1]
        print(
            f"fleet: {fleet['fleet_tokens_per_s']:.0f} tokens/s from its first request to its "
            f"last, {fleet['tokens_per_s_ratio']:.2f}x the engines alone one after another "
            f"({fleet['alone_tokens_per_s']:.0f})"
        )
        print(f"wall time {report['wall_seconds']:.0f} s, {report['date']}")
    for problem in problems:
        print(f"fleet: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
