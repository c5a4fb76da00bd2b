"""Time to first token of a returning prompt on a real vLLM engine (its CPU build), with and
without kvtier, against the limit of the medium its KV comes back from, in one command.

A long prompt, an unrelated one that evicts it from the engine's own KV cache (it needs every
block the engine has), then the first prompt again, with `max_tokens` 1: the return's time is
its time to first token. Set-ups (`--setups`):

- `vllm`: vLLM alone: the return is recomputed. Before the evicting prompt, the same engine
  serves the long prompt three more times, fully in its own cache but for its last block, which
  vLLM always computes: the fastest of them is the *engine hit*.
- `primary`: kvtier's CPU primary: the return is loaded from it (`host`).
- `file`, `file/segments`, `redis`, `s3`: a warm restart. A first engine, with every selected
  tier written through, sends the long prompt and steps until its stores and demotions have
  ended (the scenario's `settle`); each tier must then hold all of the prompt's blocks. Then,
  per set-up, a second engine process with that tier alone (its primary empty) warms up and
  sends the prompt: its KV is promoted from the tier and loaded.
- `file/warm-start`: `file` with `primary.warm_start` (the prompt's KV bytes) in the second
  engine: the tier's blocks are read into its primary from its start, so the return finds them
  there (`host`), promoted before it came. Its limit (the disk's) is not on the return's path.

Every engine process first serves a short unrelated prompt: its *first request*, measured per
set-up against vLLM alone's first request in the same round (`first`; it pays vLLM's one-time
costs, and kvtier's start must add nothing to them: the primary's prefault, a warm start), and
kept out of the return's time. Each round runs every set-up, in an order rotated by one per
round; figures are medians over rounds, ratios are taken per round, then their median.

The limit of each set-up is the prompt's KV bytes over the raw read bandwidth of its medium,
measured in the same round on the same bytes (`bench/media.py`: a numpy copy for the primary,
O_DIRECT reads of the tier's own files for the disk, a pipelined GET of the tier's keys or
redis-benchmark GETs of as many values of their size for Redis, the faster, GETs of the tier's
objects for S3), plus the engine hit's time to first token. Promotion
throughput is the tier's bytes promoted over the summed time of its promotion jobs, inside the
engine, against the same raw bandwidth.

Checked, and the command fails when one does not hold: the cached tokens of every return (none
for vLLM alone, all of the prompt from the set-up's source otherwise), the bytes loaded, and
the first token of every return, equal to vLLM alone's. Promotions get a 5 s deadline so that a
busy machine measures a slow promotion, not a miss.

    python bench/ttft.py [--rounds 3]
                         [--setups vllm,primary,file,file/segments,file/warm-start,redis,s3]
                         [--dir DIR] [--model-dir DIR] [--smoke] [--json]

`--smoke`: the 2-layer Llama of connectors/vllm/run.py, short prompts, one round (CI).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import media  # noqa: E402
from bench.ttft_report import SETUPS, Progress, machine, print_table, summarize  # noqa: E402
from bench.ttft_restart import RESTART_SETUPS as RESTART  # noqa: E402
from kvtier.demo import MODEL as DEMO_MODEL  # noqa: E402
from kvtier.operations import PLACEHOLDER  # noqa: E402
from kvtier.scenario import run_scenario  # noqa: E402
from kvtier.servers import RedisServer, SeaweedS3  # noqa: E402
from tiering.config import tier_from_config  # noqa: E402
from tiering.config.loader import parse_config  # noqa: E402

ENGINE_BLOCK = 32
"""Tokens per engine block (connectors/vllm/run.py), and per kvtier block."""
DEADLINE = "5s"
HITS = 3
"""Times vLLM alone's engine serves the prompt again at once, fully in its own cache: the engine
hit is the fastest of them (a limit is the best the engine does)."""


@dataclass(frozen=True, slots=True)
class Workload:
    """The model and the prompts' sizes. `model`: the scenario's `model` (None: run.py's
    2-layer Llama); `kv_bytes_per_token`: its KV bytes per token (layers x K and V x KV heads x
    head size x 4 bytes), checked against the bytes the engine loads."""

    model: dict[str, Any] | None
    kv_bytes_per_token: int
    engine_blocks: int
    prompt_tokens: int
    warmup_tokens: int

    @property
    def evictor_tokens(self) -> int:
        """An unrelated prompt that needs every block of the engine (one is vLLM's null block),
        so none of the long prompt's stays."""
        return (self.engine_blocks - 1) * ENGINE_BLOCK - 1

    @property
    def max_model_len(self) -> int:
        return self.evictor_tokens + 1

    @property
    def kv_bytes(self) -> int:
        return self.prompt_tokens * self.kv_bytes_per_token

    @property
    def blocks(self) -> int:
        return self.prompt_tokens // ENGINE_BLOCK


FULL = Workload(
    model=dict(DEMO_MODEL),  # the demo's 8-layer Llama
    kv_bytes_per_token=8 * 2 * 8 * 64 * 4,  # 32 KiB: 64 MiB for 2,048 tokens
    engine_blocks=66,
    prompt_tokens=2048,
    warmup_tokens=64,
)
SMOKE = Workload(
    model=None,
    kv_bytes_per_token=2 * 2 * 2 * 32 * 4,
    engine_blocks=18,
    prompt_tokens=320,
    warmup_tokens=32,
)


def rotated(names: Sequence[str], round_: int) -> list[str]:
    """The set-ups' order in round `round_`: each round starts one later."""
    at = round_ % len(names)
    return [*names[at:], *names[:at]]


def tokens(seed: str, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(count)]


class Bench:
    """The benchmark process: runs the engines (vLLM's environment, through
    `kvtier.scenario`), owns the scratch directory and the servers."""

    def __init__(
        self, workload: Workload, python: Path, scratch: Path, model_dir: Path, setups: list[str]
    ) -> None:
        self.workload, self.python, self.scratch = workload, python, scratch
        self.model_dir = model_dir
        self.setups = setups
        self.runs = scratch / "runs"
        self.runs.mkdir(parents=True, exist_ok=True)
        self.redis: RedisServer | None = None
        self.s3: SeaweedS3 | None = None

    def start_servers(self) -> None:
        if "redis" in self.setups:
            self.redis = RedisServer(self.scratch / "redis")
            self.redis.start()
        if "s3" in self.setups:
            self.s3 = SeaweedS3(self.scratch / "seaweedfs")
            self.s3.start()

    def stop_servers(self) -> None:
        for server in (self.redis, self.s3):
            if server is not None:
                server.stop()

    # -- engines ---------------------------------------------------------------------------------

    def engine(
        self,
        prompts: list[list[int]],
        tiers: list[dict[str, Any]] | None,
        settle: bool = False,
        warm_start: int = 0,
        primary: dict[str, Any] | None = None,
        **more: Any,
    ) -> dict[str, Any]:
        """One engine process serving `prompts` in turn; `tiers` None: without kvtier;
        `warm_start`: the primary's `warm_start` in bytes; `primary`: more of the primary's
        options; `more`: more of the scenario's keys (`kvtier.scenario`)."""
        w = self.workload
        extra = None
        if tiers is not None:
            capacity = -(-4 * w.evictor_tokens * w.kv_bytes_per_token // 2**20)  # MiB, rounded up
            extra = {
                "spec_name": "TieredOffloadingSpec",
                "spec_module_path": "connectors.vllm",
                "kvtier": {
                    "version": 1,
                    "primary": {
                        "capacity": f"{max(capacity, 8)}MiB",
                        "warm_start": warm_start,
                        **(primary or {}),
                    },
                    "tiers": tiers,
                    "promotion": {"gate": "always", "deadline": DEADLINE},
                },
            }
        scenario = {
            "model_dir": str(self.model_dir),
            "engine_blocks": w.engine_blocks,
            "max_model_len": w.max_model_len,
            "max_tokens": 1,
            "prompts": prompts,
            "extra": extra,
            "settle": settle,
            **({"model": w.model} if w.model is not None else {}),
            **more,
        }
        return run_scenario(self.python, scenario, self.runs)

    def tier(self, name: str, round_: int) -> dict[str, Any]:
        """The config of set-up `name`'s tier in round `round_` (storage of its own)."""
        common = {"write": "through"}
        if name in ("file", "file/segments", "file/warm-start"):
            layout = "segments" if name == "file/segments" else "files"
            label = "warm" if name == "file/warm-start" else layout
            path = self.scratch / f"round{round_}" / label
            return {
                "name": f"nvme-{label}",
                "type": "file",
                "path": str(path),
                "layout": layout,
                "min_free": 0,
                **common,
            }
        if name == "redis":
            assert self.redis is not None
            return {"name": "redis", "type": "redis", "url": self.redis.url, **common}
        assert name == "s3" and self.s3 is not None
        return {
            "name": "s3",
            "type": "s3",
            "bucket": self.s3.bucket,
            "prefix": f"ttft-round{round_}/",
            "endpoint_url": self.s3.endpoint,
            "access_key": self.s3.ACCESS_KEY,
            "secret_key": self.s3.SECRET_KEY,
            **common,
        }

    def bandwidth(self, name: str, tier: dict[str, Any]) -> media.Bandwidth:
        """The raw read bandwidth of the bytes `tier` holds."""
        if tier["type"] == "file":
            return media.disk_read(p for p in Path(tier["path"]).rglob("*") if p.is_file())
        if tier["type"] == "redis":
            return media.redis_get(tier["url"], b"kvtier:*")
        assert self.s3 is not None
        client = self.s3.client()
        return media.s3_get(client, tier["bucket"], tier["prefix"])

    # -- a round ---------------------------------------------------------------------------------

    def round(self, round_: int, progress: Progress) -> dict[str, Any]:
        w = self.workload
        prompt = tokens(f"ttft-prompt-{round_}", w.prompt_tokens)
        evictor = tokens(f"ttft-evictor-{round_}", w.evictor_tokens)
        order = rotated(self.setups, round_)
        record: dict[str, Any] = {"order": order, "setups": {}, "bandwidth": {}, "problems": []}
        problems: list[str] = record["problems"]
        warm = [name for name in order if SETUPS[name].warm]
        if warm:
            if self.redis is not None:
                flush(self.redis.url)
            tiers = {name: self.tier(name, round_) for name in warm}
            progress.say(f"round {round_ + 1}: fill of {', '.join(warm)}")
            self.engine([prompt], list(tiers.values()), settle=True)
            record["fill"] = {}
            for name, tier in tiers.items():
                held = stored_blocks(tier)
                record["fill"][name] = held
                if held != w.blocks:
                    problems.append(
                        f"round {round_ + 1}, {name}: the fill left {held} of the prompt's "
                        f"{w.blocks} blocks in the tier (its engine stopped before its stores "
                        "and write-through demotions ended: the scenario's `settle` must step "
                        "it until they have)"
                    )
                record["bandwidth"][name] = self.bandwidth(name, tier).as_dict()
        record["bandwidth"]["primary"] = media.memcpy(w.kv_bytes).as_dict()
        for name in order:
            progress.say(f"round {round_ + 1}: {name}")
            warmup = tokens(f"ttft-warmup-{round_}-{name}", w.warmup_tokens)
            if name == "vllm":
                hits = [prompt] * HITS
                result = self.engine([warmup, prompt, *hits, evictor, prompt], None)
                served = result["outputs"][2 : 2 + HITS]
                hit = min(served, key=lambda o: float(o["seconds"]))
                record["engine_hit"] = {
                    "seconds": hit["seconds"],
                    "all_seconds": [o["seconds"] for o in served],
                    "cached_tokens": [o["cached_tokens"] for o in served],
                    "tokens": [o["tokens"] for o in served],
                }
                if any(o["cached_tokens"] != w.prompt_tokens - ENGINE_BLOCK for o in served):
                    problems.append(
                        f"round {round_ + 1}: the engine hits found "
                        f"{record['engine_hit']['cached_tokens']} tokens in the engine's cache, "
                        f"not {w.prompt_tokens - ENGINE_BLOCK} each"
                    )
            elif name == "primary":
                result = self.engine([warmup, prompt, evictor, prompt], [])
            else:
                warm_start = w.kv_bytes if SETUPS[name].warm_start else 0
                result = self.engine([warmup, prompt], [self.tier(name, round_)], False, warm_start)
            out = result["outputs"][-1]
            record["setups"][name] = {
                "first": result["outputs"][0]["seconds"],  # the engine process's first request
                "seconds": out["seconds"],
                "cached_tokens": out["cached_tokens"],
                "tokens": out["tokens"],
                "logprobs": out["logprobs"],
                "metrics": {k: v for k, v in result["metrics"].items() if v},
            }
            problems += self.check(round_, name, record["setups"][name])
        reference = record["setups"]["vllm"]
        for name, got in record["setups"].items():
            if got["tokens"] != reference["tokens"]:
                problems.append(
                    f"round {round_ + 1}, {name}: first token {got['tokens']}, vLLM alone's "
                    f"{reference['tokens']}"
                )
        if any(t != reference["tokens"] for t in record["engine_hit"]["tokens"]):
            problems.append(f"round {round_ + 1}: an engine hit's first token differs")
        return record

    def check(self, round_: int, name: str, got: dict[str, Any]) -> list[str]:
        """What a set-up's return must have found, and loaded."""
        w, setup, metrics = self.workload, SETUPS[name], got["metrics"]
        where = f"round {round_ + 1}, {name}"
        if setup.source is None:
            if got["cached_tokens"] == 0:
                return []
            return [
                f"{where}: the return found {got['cached_tokens']} cached tokens, none "
                "expected (the evicting prompt left some of the prompt in the engine)"
            ]
        problems = []
        expected = {
            "cached tokens": (got["cached_tokens"], w.prompt_tokens),
            setup.source: (metrics.get(setup.source, 0), w.prompt_tokens),
            "load_bytes": (metrics.get("load_bytes", 0), w.kv_bytes),
        }
        if setup.warm:
            if setup.warm_start:  # all read at start, none on the return's path
                expected["blocks_warmed"] = (metrics.get("blocks_warmed", 0), w.blocks)
            else:
                expected["host_cached_tokens"] = (metrics.get("host_cached_tokens", 0), 0)
            expected["tier_promotions"] = (metrics.get("tier_promotions", 0), w.blocks)
        for what, (found, want) in expected.items():
            if found != want:
                problems.append(f"{where}: {what} {found:g}, expected {want:g}")
        return problems


def flush(url: str) -> None:
    """Empty the benchmark's own Redis server: a round's tier holds that round's blocks only."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushall()
    finally:
        client.close()


def stored_blocks(tier: dict[str, Any]) -> int:
    """Blocks `tier` holds, over all its namespaces (as `kvtier stats` counts them)."""
    config = parse_config({"version": 1, "tiers": [tier]})
    (cfg,) = config.tiers

    async def count() -> int:
        async with tier_from_config(cfg, PLACEHOLDER, config, read_only=True) as probe:
            namespaces = await probe.namespaces()
        total = 0
        for namespace in namespaces:
            async with tier_from_config(cfg, namespace, config, read_only=True) as held:
                total += (await held.stat()).objects
        return total

    return asyncio.run(count())


def run_rounds(
    args: argparse.Namespace,
    setups: list[str],
    rounds_of: Callable[[Bench], Callable[[int, Progress], dict[str, Any]]],
    prefix: str,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The benchmark process for `args` (`--rounds`, `--smoke`, `--dir`, `--model-dir`,
    `--vllm-python`): a `Bench` of `setups` in a scratch directory named `prefix`, its servers
    started, `rounds_of(bench)`'s round run `--rounds` times, all of it removed after; the
    records and the report's head (date, machine and load, wall time)."""
    rounds = args.rounds or (1 if args.smoke else 3)
    workload = SMOKE if args.smoke else FULL
    if args.vllm_python is None:
        from kvtier.venv import ensure_vllm_venv

        args.vllm_python = ensure_vllm_venv()
    scratch = Path(tempfile.mkdtemp(prefix=prefix, dir=args.dir))
    bench = Bench(workload, args.vllm_python, scratch, args.model_dir or scratch / "model", setups)
    one_round, progress = rounds_of(bench), Progress()
    started, load = time.time(), os.getloadavg()
    try:
        bench.start_servers()
        records = [one_round(r, progress) for r in range(rounds)]
    finally:
        bench.stop_servers()
        shutil.rmtree(scratch, ignore_errors=True)
    head = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "machine": {**machine(), "load_before": load, "load_after": os.getloadavg()},
        "wall_seconds": time.time() - started,
    }
    return records, head


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="default 3 (--smoke: 1)")
    parser.add_argument(
        "--setups",
        default=",".join(SETUPS),
        help=f"comma-separated, of {', '.join(SETUPS)} (vllm, the reference, always runs)",
    )
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (a real disk)")
    parser.add_argument("--model-dir", type=Path, default=None, help="keep the model here")
    parser.add_argument("--vllm-python", type=Path, default=None, help="vLLM environment's python")
    parser.add_argument("--smoke", action="store_true", help="tiny model, short prompts (CI)")
    parser.add_argument(
        "--restart",
        default=None,
        help=f"run the restart set-up (bench/ttft_restart.py) instead, of {', '.join(RESTART)}",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.restart is not None:
        from bench.ttft_restart import main as restart_main

        return restart_main(args)
    setups = ["vllm"] + [s for s in args.setups.split(",") if s and s != "vllm"]
    unknown = [s for s in setups if s not in SETUPS]
    if unknown:
        parser.error(f"unknown set-up {unknown[0]!r}; known: {', '.join(SETUPS)}")
    setups = [s for s in SETUPS if s in setups]  # the round's base order
    records, head = run_rounds(args, setups, lambda bench: bench.round, "kvtier-ttft-")
    workload = SMOKE if args.smoke else FULL
    problems = [p for r in records for p in r["problems"]]
    report: dict[str, Any] = {
        **head,
        "workload": {
            **asdict(workload),
            "evictor_tokens": workload.evictor_tokens,
            "kv_bytes": workload.kv_bytes,
        },
        "rounds": len(records),
        "rows": summarize(records, workload.kv_bytes),
        "per_round": records,
        "problems": problems,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
        print(f"wall time {report['wall_seconds']:.0f} s, {report['date']}")
    for problem in problems:
        print(f"ttft: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
