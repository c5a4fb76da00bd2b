"""`kvtier plan`: the model behind it (the real primary pool, a tier per configured one) and
the command (table, JSON, picture, bad input)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections import OrderedDict
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.plan import PRIMARY, Layer, Pricing, order_of, plan, run_plan
from kvtier.replay import replay
from kvtier.trace import TraceRequest, load_trace, trace_keys
from tiering.config import parse_config

REQUESTS = 1500


@pytest.fixture(scope="module")
def requests(mooncake_trace: Path) -> list[TraceRequest]:
    return list(load_trace(mooncake_trace).requests[:REQUESTS])


def _independent(requests: list[TraceRequest], tier_blocks: int, by_use: bool) -> float:
    """An LRU primary of 64 blocks and one write-through tier, written apart from the
    product's code: the hit rate over the second half."""
    primary: OrderedDict[bytes, None] = OrderedDict()
    tier: OrderedDict[bytes, None] = OrderedDict()
    hits = total = 0
    for index, (request, keys) in enumerate(zip(requests, trace_keys(requests), strict=True)):
        served = 0
        for key in keys:
            if key in primary:
                primary.move_to_end(key)
            elif key in tier:
                if by_use:
                    tier.move_to_end(key)
            else:
                break
            served += 1
        for key in keys[served:]:
            tier[key] = None
            while len(tier) > tier_blocks:
                tier.popitem(last=False)
        for key in keys:  # promoted and new blocks enter the primary, in the request's order
            primary[key] = None
            primary.move_to_end(key)
        while len(primary) > 64:
            primary.popitem(last=False)
        if index >= len(requests) // 2:
            tokens = request.block_tokens()
            hits += sum(tokens[:served])
            total += sum(tokens)
    return hits / total


def test_without_tiers_the_plan_is_the_pool_replay(requests: list[TraceRequest]) -> None:
    keys = trace_keys(requests)
    for policy in ("lru", "arc"):
        for capacity in (64, 512):
            got = plan(requests, keys, capacity, policy, [], Pricing())
            assert got.hit_rate == replay(requests, capacity, policy).hit_rate
            assert got.rate(PRIMARY) == got.hit_rate


@pytest.mark.parametrize(("medium", "order"), [("file", None), ("s3", None), ("s3", "write")])
def test_a_tier_behind_the_primary_matches_an_independent_model(
    requests: list[TraceRequest], medium: str, order: str | None
) -> None:
    """By use for every medium (S3 with its records of reads), by write order for an S3 tier
    that keeps none (`reads_interval: 0`)."""
    keys = trace_keys(requests)
    for blocks in (256, 2048):
        layer = Layer("t", medium, blocks, order=order)
        got = plan(requests, keys, 64, "lru", [layer], Pricing())
        expected = _independent(requests, blocks, by_use=order != "write")
        assert abs(got.hit_rate - expected) < 0.005, (medium, blocks, got.hit_rate, expected)


def test_more_tier_buys_more_and_use_beats_write_order(requests: list[TraceRequest]) -> None:
    tiers = [(Layer("nvme", "file", 0), [0, 512, 4096])]
    results = run_plan(requests, [64], ["lru"], tiers, Pricing())
    rates = [r.hit_rate for r in results]
    assert rates == sorted(rates) and rates[0] < rates[-1]
    assert results[0].rate("nvme") == 0
    keys = trace_keys(requests)
    by_use = plan(requests, keys, 64, "lru", [Layer("a", "file", 4096)], Pricing())
    by_write = plan(requests, keys, 64, "lru", [Layer("a", "s3", 4096, order="write")], Pricing())
    assert by_use.hit_rate > by_write.hit_rate + 0.005  # 11.3 % against 10.1 %


def test_an_s3_tier_without_records_of_reads_is_planned_by_write_order() -> None:
    """`reads_interval: 0` in the config: the planner's layer goes by write order; the
    default (records of reads every 30 s) by use, as `files` and Redis."""
    base = {"type": "s3", "bucket": "b", "capacity": "1GiB"}
    off = parse_config({"tiers": [{"name": "o", **base, "reads_interval": 0}]}).tiers[0]
    on = parse_config({"tiers": [{"name": "o", **base}]}).tiers[0]
    assert order_of(off) == "write" and order_of(on) is None
    assert not Layer("o", "s3", 1, order=order_of(off)).by_use
    assert Layer("o", "s3", 1, order=order_of(on)).by_use


def test_a_selective_tier_never_admitted_is_no_tier(requests: list[TraceRequest]) -> None:
    keys = trace_keys(requests)
    alone = plan(requests, keys, 64, "lru", [], Pricing())
    never = Layer("t", "file", 4096, "selective", admit_after_hits=10**9)
    assert plan(requests, keys, 64, "lru", [never], Pricing()).hit_rate == alone.hit_rate
    back = plan(requests, keys, 64, "lru", [Layer("t", "file", 4096, "back")], Pricing())
    assert back.hit_rate > alone.hit_rate


def test_the_price_of_a_hit(requests: list[TraceRequest]) -> None:
    keys = trace_keys(requests)
    pricing = Pricing(token_bytes=1000, prefill_rate=100.0, bandwidth={"t": 0.001})
    got = plan(requests, keys, 64, "lru", [Layer("t", "file", 2048)], pricing)
    assert got.saved_seconds == pytest.approx(got.hits / 100.0)
    primary_s = got.hit_tokens[PRIMARY] * 1000 / 20e9
    assert got.load_seconds == pytest.approx(primary_s + got.hit_tokens["t"] * 1000 / 1e6)
    assert got.net_seconds == pytest.approx(got.saved_seconds - got.load_seconds)


def test_the_command_prints_a_table_json_and_an_svg(
    mooncake_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    picture = tmp_path / "plan.svg"
    argv = ["plan", str(mooncake_trace), "--requests", "600", "--primary", "64,256"]
    argv += ["--policy", "lru,arc", "--tier", "nvme=0,1024", "--picture", str(picture)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "hit rate" in out and "nvme %" in out and f"picture: {picture}" in out
    assert len([line for line in out.splitlines() if line.startswith(("lru ", "arc "))]) == 8
    svg = ET.parse(picture).getroot()
    lines = svg.findall("{http://www.w3.org/2000/svg}polyline")
    assert len(lines) == 4  # one curve per policy and tier size, x: the primary
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["configurations"]) == 8
    first = data["configurations"][0]
    assert set(first["hit_rate_by_layer"]) == {"primary", "nvme"}
    assert first["tokens_not_recomputed"] <= first["total_tokens"]


def test_a_png_when_matplotlib_is_there(mooncake_trace: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")  # the test extra installs it
    picture = tmp_path / "plan.png"
    argv = ["plan", str(mooncake_trace), "--requests", "300", "--primary", "64"]
    assert main([*argv, "--tier", "nvme=0,256,1024", "--picture", str(picture)]) == 0
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--tier", "nvme"], "expected NAME[:MEDIUM[:WRITE]]=SIZE"),
        (["--tier", "nvme:file:sideways=10"], "write mode"),
        (["--picture", "plan.gif"], ".svg or .png"),
        (["--bandwidth", "nvme=fast"], "expected NAME=GB/s"),
        (["--primary", "100000000000"], "at most"),
        (["--policy", "nonesuch"], "nonesuch"),
        (["--measure"], "--measure needs --config"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    mooncake_trace: Path,
    extra: list[str],
    says: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    argv = ["plan", str(mooncake_trace), "--primary", "64", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err and "Traceback" not in err
    assert not (tmp_path / "plan.gif").exists()


def test_a_config_tier_without_capacity_must_be_given_sizes(
    mooncake_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "kvtier.yaml"
    config.write_text(
        "version: 1\nprimary: {capacity: 64MiB}\n"
        f"tiers:\n  - {{name: nvme, type: file, path: {tmp_path / 'nvme'}, write: through}}\n"
    )
    argv = ["plan", str(mooncake_trace), "--requests", "300", "--primary", "64"]
    assert main([*argv, "--config", str(config)]) == 2
    assert "--tier nvme=" in capsys.readouterr().err
    assert main([*argv, "--config", str(config), "--tier", "nvme=512"]) == 0
    assert "nvme 512" in capsys.readouterr().out


def test_a_shared_tier_is_planned_by_the_fleet_replay(
    mooncake_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvtier plan --engines` reports for a shared tier what `kvtier replay --engines` gives
    for the same fleet (issue 44, item 4): the same replay, not the single-engine model."""
    config = tmp_path / "kvtier.yaml"
    config.write_text(
        "version: 1\nprimary: {capacity: 64MiB}\n"
        "tiers:\n  - {name: shared, type: memory, capacity: 64MiB, write: through}\n"
    )
    common = [str(mooncake_trace), "--config", str(config), "--requests", "400"]
    common += ["--engines", "3", "--route", "random", "--json"]
    assert main(["replay", *common, "--capacity", "64", "--shared-blocks", "512"]) == 0
    fleet = json.loads(capsys.readouterr().out)["results"][0]["fleet"]
    argv = ["plan", *common, "--primary", "64", "--policy", "lru", "--tier", "shared=512"]
    assert main(argv) == 0
    (got,) = json.loads(capsys.readouterr().out)["configurations"]
    assert got["hit_rate"] == pytest.approx(fleet["hit_rate"])
    assert got["hit_rate_by_layer"]["shared"] == pytest.approx(fleet["shared_hit_rate"])
    assert main([*argv[:-2], "--tier", "shared=512,1024", "--measure"]) == 2
