"""`kvtier replay --engines N`: a trace through a fleet of tiering managers over one shared tier
(kvtier/fleet/), against the single-engine replay, a real Redis, and its own command line."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import redis

import kvtier.fleet.run
from kvtier.cli import main
from kvtier.fleet import (
    EngineFigures,
    FleetResult,
    check_fleet,
    replay_fleet,
    route_requests,
    session_of,
)
from kvtier.fleet.recency import ENOUGH_TICKS
from kvtier.fleet.run import arrivals
from kvtier.replay import REPLAY_NAMESPACE, replay_tiered
from kvtier.servers import RedisServer, free_port
from kvtier.trace import TraceRequest, load_trace
from tiering.config import Config, parse_config
from tiering.errors import ConfigError
from tiering.keys import make_key
from tiers.memory import MemoryTier

BLOCK = 64
"""Bytes of each synthesized block: the primaries stay small."""
NEED_ENGINES = "--route, --seed, --shared-blocks and --pace need --engines N"


def object_bytes(block_bytes: int = BLOCK) -> int:
    """Bytes a memory tier holds for one block (its header, then the block)."""

    async def put() -> int:
        async with MemoryTier(namespace=REPLAY_NAMESPACE) as tier:
            await tier.put(make_key(bytes(32)), bytes(block_bytes))
            return (await tier.stat()).bytes_used

    return asyncio.run(put())


OBJECT = object_bytes()


def config(tier: dict[str, Any] | None = None, **sections: Any) -> Config:
    shared = {"name": "shared", "type": "memory", "write": "through", **(tier or {})}
    return parse_config(
        {
            "primary": {"eviction": "lru"},
            "promotion": {"gate": "always", "deadline": "10s"},  # deadlines are real time:
            "faults": {"timeout": "10s"},  # room on a loaded machine
            "tiers": [shared],
            **sections,
        }
    )


@pytest.fixture(scope="module")
def requests(mooncake_trace: Path) -> tuple[TraceRequest, ...]:
    return load_trace(mooncake_trace).requests


def counts(result: FleetResult) -> list[dict[str, Any]]:
    """Every engine's figures and the fleet's, without the manager's tier figures (timings)."""
    rows = []
    for row in (*result.per_engine, result.fleet):
        figures = row.as_dict()
        figures.pop("tier", None)
        rows.append(figures)
    return rows


def test_one_engine_is_the_single_engine_tiered_replay(requests: tuple[TraceRequest, ...]) -> None:
    """A fleet of one is `kvtier replay --config`: the same hits, from the same places, with the
    same writes, through a shared tier small enough to evict."""
    trace, cfg = requests[:400], config({"capacity": "1MiB"})
    single = replay_tiered(trace, cfg, capacity=256, block_bytes=BLOCK)
    fleet = replay_fleet(trace, cfg, engines=1, capacity=256, block_bytes=BLOCK)
    assert fleet.fleet.hit_tokens == single.hit_tokens > 0
    assert fleet.fleet.total_tokens == single.total_tokens
    assert fleet.fleet.shared_hit_tokens == single.tier_hit_tokens["shared"] > 0
    assert fleet.fleet.writes == single.stats["tiers"]["shared"]["demotions"]
    assert fleet.store_counters["evictions"] > 0
    assert fleet.fleet.cross_hit_tokens == fleet.fleet.duplicate_writes == 0
    assert counts(fleet)[0] == {**counts(fleet)[1], "engine": 0}


@pytest.mark.parametrize(("engines", "route"), [(2, "random"), (64, "sticky")])
def test_engines_hit_blocks_another_engine_stored(
    requests: tuple[TraceRequest, ...], engines: int, route: str
) -> None:
    """On the shipped trace: with random routing a conversation's next turn often lands on
    another engine; with sticky routing only the prefix every request shares (the system
    prompt) crosses, for engines whose first request is in the measured half."""
    result = replay_fleet(requests[:300], config(), engines, 256, route, block_bytes=BLOCK)
    fleet = result.fleet
    assert 0 < fleet.cross_hit_blocks <= fleet.shared_hit_blocks
    assert 0 < fleet.cross_hit_tokens <= fleet.shared_hit_tokens
    assert sum(row.cross_hit_blocks for row in result.per_engine) == fleet.cross_hit_blocks
    assert len(result.per_engine) == engines
    assert sum(row.requests for row in result.per_engine) == 300


def sessions_on_distinct_engines(
    trace: list[TraceRequest], engines: int, route: str
) -> tuple[int, list[int]]:
    """A seed that routes the requests of `trace` one to an engine each, and where they go."""
    for seed in range(1000):
        where = route_requests(trace, engines, route, seed)
        if len(set(where)) == len(trace):
            return seed, where
    raise AssertionError("no seed spreads these requests")


def test_sticky_routing_crosses_engines_on_a_shared_prefix() -> None:
    """Two sessions that share only their first block (a system prompt), on two engines: the
    second session's first turn loads that block from the shared tier, stored by the other
    engine; its second turn finds everything in its own primary."""
    a, b = TraceRequest((7, 1, 10), 1536, 0.0), TraceRequest((7, 2, 20), 1536, 2.0)
    seed, _ = sessions_on_distinct_engines([a, b], 2, "sticky")
    trace = [a, TraceRequest((7, 1, 10, 11), 2048, 1.0), b, TraceRequest((7, 2, 20, 21), 2048, 3.0)]
    result = replay_fleet(trace, config(), 2, 64, "sticky", seed, BLOCK)
    assert result.fleet.shared_hit_blocks == result.fleet.cross_hit_blocks == 1
    assert result.fleet.cross_hit_tokens == 512
    assert result.fleet.hit_tokens == 512 + 3 * 512  # block 7; then 7, 2, 20 of the last
    assert result.fleet.duplicate_writes == 0


@pytest.mark.parametrize("route", ["sticky", "random"])
def test_engines_given_requests_at_once_write_the_same_blocks(route: str) -> None:
    """Three requests that arrive together on three engines all miss their common first
    block, and each writes it: two duplicate writes. Arriving one after another, the later
    ones find it in the shared tier instead (cross-engine hits) and write it never again."""
    together = [TraceRequest((7, 100 + i, 200 + i), 1536, 0.0) for i in range(3)]
    seed, _ = sessions_on_distinct_engines(together, 3, route)
    result = replay_fleet(together, config(), 3, 64, route, seed, BLOCK)
    assert result.fleet.writes == 9 and result.fleet.duplicate_writes == 2
    assert result.fleet.duplicate_bytes == 2 * OBJECT
    assert result.store_objects == 7 and result.fleet.cross_hit_blocks == 0
    apart = [TraceRequest(r.hash_ids, r.input_length, float(i)) for i, r in enumerate(together)]
    result = replay_fleet(apart, config(), 3, 64, route, seed, BLOCK)
    assert result.fleet.writes == 7 and result.fleet.duplicate_writes == 0
    assert result.fleet.cross_hit_blocks == 2  # requests 1 and 2 (the measured half): block 7


def test_the_shared_tier_stays_within_its_capacity(
    requests: tuple[TraceRequest, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvtier.fleet.run, "STORE_SAMPLE", 16)  # a look every 16 requests
    seen: list[int] = []
    stat = kvtier.fleet.run.Fleet.store_stat

    def looked(fleet: kvtier.fleet.run.Fleet) -> Any:
        got = stat(fleet)
        assert got is not None
        seen.append(got.bytes_used)
        return got

    monkeypatch.setattr(kvtier.fleet.run.Fleet, "store_stat", looked)
    capacity = 48 << 10
    result = replay_fleet(
        requests[:500], config({"capacity": capacity}), 8, 256, "random", 3, BLOCK
    )
    assert len(seen) >= 500 // 16
    assert max(seen) == result.store_peak_bytes <= capacity == result.store_capacity
    assert result.store_peak_bytes > capacity - OBJECT  # full, and evicting to stay so
    assert result.store_counters["evictions"] > 0
    assert result.store_objects == result.store_bytes // OBJECT
    unbounded = replay_fleet(requests[:20], config(), 2, 256, block_bytes=BLOCK)
    assert unbounded.store_capacity is None and unbounded.store_peak_bytes > 0


def test_random_routing_is_reproducible_with_a_seed(requests: tuple[TraceRequest, ...]) -> None:
    trace = requests[:300]
    assert route_requests(trace, 8, "random", 5) == route_requests(trace, 8, "random", 5)
    assert route_requests(trace, 8, "random", 5) != route_requests(trace, 8, "random", 6)
    assert set(route_requests(trace, 8, "random", 5)) == set(range(8))
    first, again, other = (
        replay_fleet(trace, config({"capacity": "256KiB"}), 4, 256, "random", seed, BLOCK)
        for seed in (5, 5, 6)
    )
    assert counts(first) == counts(again)
    assert first.store_bytes == again.store_bytes and first.store_objects == again.store_objects
    assert counts(first) != counts(other)


def test_sticky_routing_keeps_each_session_on_one_engine(
    requests: tuple[TraceRequest, ...],
) -> None:
    where = route_requests(requests, 16, "sticky", 0)
    engines_of: defaultdict[tuple[int, ...], set[int]] = defaultdict(set)
    for request, engine in zip(requests, where, strict=True):
        engines_of[session_of(request)].add(engine)
    assert len(engines_of) > 7000  # the shipped trace's conversations, not its one first block
    assert all(len(engines) == 1 for engines in engines_of.values())
    assert set(where) == set(range(16))
    assert route_requests(requests, 16, "sticky", 1) != where  # the seed places sessions


def test_arrivals_group_requests_stamped_alike() -> None:
    stamps = [0.0, 0.0, 3.0, None, None, 2.0, 5.0, 5.0]
    trace = [TraceRequest((i,), 10, stamp) for i, stamp in enumerate(stamps)]
    assert arrivals(trace) == [
        (0.0, [0, 1]),
        (3.0, [2]),
        (4.0, [3]),  # no timestamp: alone, a second after the one before
        (5.0, [4]),
        (5.0, [5]),  # stamped earlier than the one before: time does not go back
        (5.0, [6, 7]),
    ]


@pytest.mark.redis
def test_three_engines_on_redis_count_as_the_memory_stand_in(
    requests: tuple[TraceRequest, ...], redis_server: RedisServer
) -> None:
    """The same trace through three engines on a real Redis and through the memory tier that
    stands in for it beyond `MAX_SERVER_ENGINES`: every count of every engine is the same (the
    stand-in is seen through existence checks, as Redis is), and so is what the store holds."""
    client = redis.Redis(host="127.0.0.1", port=redis_server.port, db=5)
    client.flushdb()
    url = f"redis://127.0.0.1:{redis_server.port}/5"
    trace = requests[:300]
    on_redis = replay_fleet(
        trace, config({"type": "redis", "url": url}), 3, 256, "random", 0, BLOCK
    )
    stand_in = replay_fleet(trace, config(), 3, 256, "random", 0, BLOCK)
    assert counts(on_redis) == counts(stand_in)
    assert on_redis.fleet.cross_hit_blocks > 0 and on_redis.fleet.duplicate_writes > 0
    assert on_redis.store_objects == stand_in.store_objects
    assert on_redis.store_bytes is not None and stand_in.store_bytes is not None
    assert on_redis.store_bytes >= stand_in.store_bytes  # (the server's: keys and overhead)
    assert client.dbsize() == on_redis.store_objects
    client.flushdb()
    client.close()


@pytest.mark.redis
def test_a_look_at_redis_uses_none_of_its_blocks(
    requests: tuple[TraceRequest, ...], redis_server: RedisServer
) -> None:
    """The replay looks at the shared store's blocks every few requests; on Redis a look
    counts them (SCAN, MEMORY USAGE) without reading them (STRLEN would stamp every key as just
    used, and `allkeys-lru` would then evict among them at random)."""
    client = redis.Redis(host="127.0.0.1", port=redis_server.port, db=6)
    client.flushdb()
    cfg = config({"type": "redis", "url": f"redis://127.0.0.1:{redis_server.port}/6"})
    replay_fleet(requests[:40], cfg, 2, 64, "random", 0, BLOCK)
    blocks = [name for name in client.scan_iter(match=b"kvtier:*:*", count=1000)]
    assert blocks
    time.sleep(2.1)  # (Redis's LRU clock ticks once a second)
    fleet = kvtier.fleet.run.Fleet(cfg, 2, 64, BLOCK, stand_in=False)
    try:
        stat = fleet.store_stat()
    finally:
        fleet.close()
    assert stat is not None and stat.objects == len(blocks)
    assert min(client.object("idletime", name) for name in blocks) >= 2
    client.flushdb()
    client.close()


def test_a_paced_replay_takes_the_trace_s_time(requests: tuple[TraceRequest, ...]) -> None:
    """`pace`: the trace's seconds replayed per wall-clock second, the arrivals waited for."""
    trace = requests[:12]
    span = (trace[-1].timestamp or 0) - (trace[0].timestamp or 0)
    assert span > 0
    started = time.monotonic()
    result = replay_fleet(trace, config(), 2, 64, "random", 0, BLOCK, pace=span / 1.5)
    assert time.monotonic() - started >= 1.5
    assert (result.trace_seconds, result.pace) == (span, span / 1.5)
    assert result.recency_tick is None and result.horizon_ticks is None  # (exact, in memory)
    with pytest.raises(ConfigError, match="--pace"):
        replay_fleet(trace, config(), 2, 64, "random", 0, BLOCK, pace=0)


@pytest.mark.redis
def test_a_replay_too_fast_for_redis_s_clock_says_so(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    redis_server: RedisServer,
    mooncake_trace: Path,
) -> None:
    """Unpaced, a replay replaces what Redis holds within a few ticks of its LRU clock (one a
    second): the output says so, and the pace that would give it enough."""
    client = redis.Redis(host="127.0.0.1", port=redis_server.port, db=7)
    client.flushdb()
    path = tmp_path / "fleet.yaml"
    tier = f"{{name: shared, type: redis, write: through, url: 'redis://127.0.0.1:{redis_server.port}/7'}}"
    path.write_text(f"primary: {{eviction: lru}}\ntiers:\n  - {tier}\n")
    args = ["replay", str(mooncake_trace), "--config", str(path), "--engines", "2"]
    args += ["--capacity", "256", "--requests", "64", "--block-bytes", "64"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "ticks of its medium's 1 s recency clock" in out
    assert f"fewer than {ENOUGH_TICKS}): it evicted at random among" in out
    assert "replay slower, about --pace" in out
    client.flushdb()
    assert main([*args, "--json"]) == 0
    shared = json.loads(capsys.readouterr().out)["results"][0]["shared_tier"]
    assert shared["recency_tick"] == 1.0 and 0 < shared["horizon_ticks"] < ENOUGH_TICKS
    client.flushdb()
    client.close()


def test_a_store_that_fails_is_misses_and_a_line(requests: tuple[TraceRequest, ...]) -> None:
    """Engines over a Redis that is not there: the replay runs to its end on the primaries
    alone, each engine's breaker opens, and the store's figures say they could not be read."""
    dead = f"redis://127.0.0.1:{free_port()}/0"
    tier = {"type": "redis", "url": dead, "connect_timeout": 0.2}
    result = replay_fleet(requests[:40], config(tier, faults={"timeout": "1s"}), 2, 256)
    assert result.store_bytes is None and result.store_objects is None
    assert result.store_error is not None and "SCAN failed" in result.store_error
    assert result.breakers_opened == 2
    assert result.fleet.writes == result.fleet.shared_hit_blocks == 0
    assert result.fleet.hit_tokens > 0  # block 0, from each engine's own primary


def test_no_engine_outlives_the_replay(requests: tuple[TraceRequest, ...]) -> None:
    result = replay_fleet(requests[:60], config(), 16, 256, "random", 0, BLOCK)
    assert len(result.per_engine) == 16
    alive = [t.name for t in threading.enumerate() if t.name.startswith("kvtier-engine-")]
    assert alive == []  # each engine's runtime thread has ended


@pytest.mark.parametrize(
    ("engines", "route", "tier", "message"),
    [
        (0, "sticky", {}, "--engines: expected 1 to 256, got 0"),
        (257, "sticky", {}, "--engines: expected 1 to 256, got 257"),
        (2, "roundrobin", {}, "--route: expected one of sticky, random, got 'roundrobin'"),
        (9, "sticky", {"type": "redis"}, "--engines 9: at most 8 engines on a real store"),
    ],
)
def test_check_fleet(engines: int, route: str, tier: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_fleet(config(tier), engines, route)
    two = parse_config(
        {"tiers": [{"name": "a", "type": "memory"}, {"name": "b", "type": "memory"}]}
    )
    with pytest.raises(ConfigError, match="exactly one secondary tier; this config has 2"):
        check_fleet(two, 2, "sticky")


class TestCommandLine:
    def trace(self, tmp_path: Path) -> Path:
        path = tmp_path / "t.jsonl"
        lines = [
            {"timestamp": 1000 * (i // 4), "input_length": 1536, "hash_ids": [0, 1 + i % 6, 50 + i]}
            for i in range(40)
        ]
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        return path

    def config(self, tmp_path: Path, tier: str = "{name: shared, type: memory}") -> Path:
        path = tmp_path / "fleet.yaml"
        path.write_text(f"version: 1\npromotion: {{gate: always}}\ntiers:\n  - {tier}\n")
        return path

    def args(self, tmp_path: Path, *more: str) -> list[str]:
        return [
            "replay",
            str(self.trace(tmp_path)),
            "--config",
            str(self.config(tmp_path)),
            "--capacity",
            "64",
            "--block-bytes",
            str(BLOCK),
            *more,
        ]

    def test_table(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        assert main(self.args(tmp_path, "--engines", "3", "--route", "random")) == 0
        out = capsys.readouterr().out.splitlines()
        assert "3 engine(s), route random (seed 0)" in out[0]
        header = out.index(next(line for line in out if line.startswith("engine ")))
        rows = [line.split() for line in out[header + 1 : header + 5]]
        assert [row[0] for row in rows] == ["0", "1", "2", "fleet"]
        assert sum(int(row[1]) for row in rows[:3]) == int(rows[3][1]) == 40
        assert out[header + 5].startswith("shared tier shared (memory): ")

    def test_json(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        args = self.args(tmp_path, "--engines", "2", "--seed", "4", "--json")
        del args[args.index("--block-bytes") : args.index("--block-bytes") + 2]
        assert main(args) == 0
        (result,) = json.loads(capsys.readouterr().out)["results"]
        assert (result["engines"], result["route"], result["seed"]) == (2, "sticky", 4)
        assert result["block_bytes"] == 64  # a fleet's default: its primaries stay small
        fleet = result["fleet"]
        assert [e["engine"] for e in result["per_engine"]] == [0, 1]
        assert fleet["hit_tokens"] == sum(e["hit_tokens"] for e in result["per_engine"]) > 0
        assert 0 <= fleet["cross_share"] <= 1 and fleet["hit_rate"] > 0
        assert set(result["shared_tier"]) >= {"bytes_used", "peak_bytes", "capacity", "objects"}

    @pytest.mark.parametrize(
        ("more", "message"),
        [
            (["--engines", "0"], "argument --engines: expected an integer from 1 to 256, got '0'"),
            (["--engines", "257"], "argument --engines: expected an integer from 1 to 256"),
            (["--engines", "2", "--route", "rr"], "argument --route: invalid choice: 'rr'"),
            (["--route", "random"], f"kvtier replay: error: {NEED_ENGINES}"),
            (["--seed", "1"], f"kvtier replay: error: {NEED_ENGINES}"),
            (["--pace", "10"], f"kvtier replay: error: {NEED_ENGINES}"),
            (["--engines", "2", "--pace", "0"], "argument --pace: expected a number above 0"),
        ],
    )
    def test_bad_flags_exit_2_with_one_line(
        self,
        tmp_path: Path,
        capsys: pytest.CaptureFixture[str],
        more: list[str],
        message: str,
    ) -> None:
        with pytest.raises(SystemExit) as exit_info:
            raise SystemExit(main(self.args(tmp_path, *more)))
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.splitlines()[-1].startswith("kvtier replay: error: ")
        assert message in err and "Traceback" not in err

    @pytest.mark.parametrize(
        ("tier", "engines", "message"),
        [
            (
                "{name: shared, type: redis, url: 'redis://127.0.0.1:1/0'}",
                "9",
                "--engines 9: at most 8 engines on a real store (tier 'shared' is redis); a "
                "memory tier stands in for the shared store up to 256",
            ),
            (
                "{name: a, type: memory}\n  - {name: b, type: memory}",
                "2",
                "tiers: a fleet replay shares exactly one secondary tier; this config has 2",
            ),
        ],
    )
    def test_bad_fleets_exit_2_with_one_line(
        self,
        tmp_path: Path,
        capsys: pytest.CaptureFixture[str],
        tier: str,
        engines: str,
        message: str,
    ) -> None:
        args = self.args(tmp_path, "--engines", engines)
        args[3] = str(self.config(tmp_path, tier))
        assert main(args) == 2
        assert capsys.readouterr().err == f"kvtier replay: error: {message}\n"

    def test_engines_need_a_config(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        args = ["replay", str(self.trace(tmp_path)), "--capacity", "8", "--engines", "2"]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert (
            err == "kvtier replay: error: --engines needs --config FILE: the config of the "
            "tier they share\n"
        )

    def test_primaries_must_fit_in_memory(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        args = self.args(tmp_path, "--engines", "256")
        args[args.index("--capacity") + 1] = "10000000"
        args[args.index("--block-bytes") + 1] = "1048576"
        assert main(args) == 2
        assert "bytes of primary memory; this machine has" in capsys.readouterr().err


@pytest.mark.slow
def test_256_engines_over_the_shipped_trace(requests: tuple[TraceRequest, ...]) -> None:
    """The largest fleet over the whole trace (minutes: marked slow): every engine serves
    requests, nearly every hit on the shared tier is another engine's block, and the shared
    tier stays within its capacity."""
    capacity = 4 << 20
    result = replay_fleet(requests, config({"capacity": capacity}), 256, 512, "random", 0, BLOCK)
    assert all(row.requests > 0 for row in result.per_engine)
    assert result.fleet.cross_share > 0.95
    assert result.store_peak_bytes <= capacity
    assert isinstance(result.fleet, EngineFigures) and result.fleet.unsettled_requests == 0


def test_a_fleet_with_a_secret_counts_the_store_it_writes(tmp_path: Path) -> None:
    """With `auth.secret` the engines store under the secret's names (issue 42): the fleet's
    look at a `files` store (a fresh instance, each engine indexing only its own) counts those,
    as many objects as without a secret, not the layout's empty names."""
    together = [TraceRequest((7, 100 + i, 200 + i), 1536, float(i)) for i in range(3)]
    counted = []
    for secret in (None, "a-fleet-secret-0123456789"):
        tier = {"type": "file", "path": str(tmp_path / f"nvme-{secret is None}"), "min_free": 0}
        sections = {} if secret is None else {"auth": {"secret": "${FLEET_SECRET}"}}
        data = {
            "primary": {"eviction": "lru"},
            "promotion": {"gate": "always", "deadline": "10s"},
            "faults": {"timeout": "10s"},
            "tiers": [{"name": "shared", "write": "through", **tier}],
            **sections,
        }
        cfg = parse_config(data, {"FLEET_SECRET": secret or ""})
        counted.append(replay_fleet(together, cfg, 3, 64, "sticky", 0, BLOCK).store_objects)
    assert counted[0] == counted[1] == 7, counted


def test_replayed_engines_with_a_warm_start_each_write_their_own_manifest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With `primary.warm_start` the replayed engines write manifests of use, as a fleet's
    engines do: each under an identity of its own (`replay-<n>`), not one record that all of
    them overwrite and that each start warns of as another live engine's."""
    together = [TraceRequest((7, 100 + i, 200 + i), 1536, float(i)) for i in range(6)]
    path = tmp_path / "nvme"
    cfg = config(
        {"type": "file", "path": str(path), "min_free": 0},
        primary={"eviction": "lru", "warm_start": 64 * BLOCK},
    )
    with caplog.at_level("WARNING", "tiering.manager.recorder"):
        replay_fleet(together, cfg, 3, 64, "random", 0, BLOCK)
    records = sorted(p.name.split(".", 1)[1] for p in (path / ".kvtier" / "records").iterdir())
    assert records == [f"manifest.replay-{n}" for n in range(3)]
    assert not [r for r in caplog.records if "engine identity" in r.getMessage()]
