"""`kvtier replay`: trace loading, the reference hit rates, and the command line."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.replay import replay
from kvtier.trace import TraceRequest, load_trace
from tests.helpers.paths import ROOT, SHARED_TRACES, SHIPPED_TRACES
from tiering.errors import TraceError

CAPACITIES = (1638, 3276, 6553, 13107, 26214)
TOLERANCE = {"lru": 0.3, "arc": 1.0}  # points, as the foundation issue sets them
README_ROWS = {"lru": "LRU", "arc": "ARC (Megiddo–Modha)"}


def reference_rows(trace: Path) -> dict[str, dict[int, float]]:
    """The reference table of the README beside the trace (percent per capacity)."""
    text = (trace.parent / "README.md").read_text()
    header = next(line for line in text.splitlines() if line.startswith("| capacity"))
    capacities = [int(c.replace(",", "")) for c in header.split("|")[2:-1]]
    rows = {}
    for policy, label in README_ROWS.items():
        line = next(line for line in text.splitlines() if line.startswith(f"| {label} |"))
        values = [float(v.strip().rstrip("%")) for v in line.split("|")[2:-1]]
        rows[policy] = dict(zip(capacities, values, strict=True))
    return rows


@pytest.fixture(scope="module")
def trace(mooncake_trace: Path):  # type: ignore[no-untyped-def]
    return load_trace(mooncake_trace)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_reproduces_reference_hit_rates(trace, mooncake_trace: Path, policy: str) -> None:  # type: ignore[no-untyped-def]
    reference = reference_rows(mooncake_trace)[policy]
    assert sorted(reference) == list(CAPACITIES)
    for capacity in CAPACITIES:
        result = replay(trace.requests, capacity, policy)
        assert result.unstored_blocks == 0
        measured = 100 * result.hit_rate
        assert abs(measured - reference[capacity]) <= TOLERANCE[policy], (
            f"{policy} at {capacity} blocks: {measured:.2f}% vs reference {reference[capacity]}%"
        )


def test_shipped_trace_is_the_shared_one() -> None:
    shared = SHARED_TRACES / "mooncake_conversation_trace.jsonl"
    shipped = SHIPPED_TRACES / "mooncake_conversation_trace.jsonl.gz"
    if not shared.exists():
        pytest.skip(
            "no shared/ checkout beside this repository (only CI and dev machines have one)"
        )
    assert gzip.decompress(shipped.read_bytes()) == shared.read_bytes()
    assert load_trace(shipped).reference_hit_rate("lru", 6553) == 15.2
    assert reference_rows(shipped) == reference_rows(shared)


def test_hit_rate_counts_second_half_by_tokens(tmp_path: Path) -> None:
    lines = [
        {"input_length": 1000, "hash_ids": [1, 2]},  # blocks of 512 and 488 tokens
        {"input_length": 1000, "hash_ids": [1, 2]},
        {"input_length": 600, "hash_ids": [1, 3]},  # hit 512 of 600
        {"input_length": 10, "hash_ids": [4]},  # miss
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = replay(load_trace(path).requests, capacity=8, policy="lru")
    assert (result.hit_tokens, result.total_tokens) == (512, 610)
    assert result.measured_requests == 2 and result.block_refs == 7


def test_requests_never_evict_their_own_blocks(tmp_path: Path) -> None:
    requests = [TraceRequest((1, 2, 3), 1536), TraceRequest((1, 4, 5), 1536)]
    result = replay(requests, capacity=3, policy="lru")
    # The second request hits block 1 and needs two slots: 2 and 3 go, never its own 1.
    assert result.evictions == 2 and result.unstored_blocks == 0
    too_long = [TraceRequest((1, 2, 3, 4), 2048)]
    assert replay(too_long, capacity=3, policy="arc").unstored_blocks == 4


def test_block_tokens() -> None:
    assert TraceRequest((1, 2, 3), 1100).block_tokens() == [512, 512, 76]
    assert TraceRequest((1, 2), 512).block_tokens() == [512, 1]  # at least one token


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"hash_ids": [1]}', "missing field 'input_length'"),
        ('{"input_length": -1, "hash_ids": [1]}', "input_length must be a non-negative integer"),
        ('{"input_length": 5, "hash_ids": [1, "x"]}', "hash_ids must be a list of non-negative"),
        ('{"input_length": 5, "hash_ids": 7}', "hash_ids must be a list"),
        (
            '{"input_length": 5, "hash_ids": [18446744073709551616]}',
            "hash_ids must be a list of non-negative integers below 2",
        ),
    ],
)
def test_malformed_line_names_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input_length": 5, "hash_ids": [1]}\n\n' + line + "\n")
    with pytest.raises(TraceError, match=re.escape(f"{path}:3: ") + message):
        load_trace(path)


def test_trace_timestamps(tmp_path: Path) -> None:
    """Milliseconds in the file, seconds in the request (a fleet replay's arrivals); a line may
    have none; anything but a number from 0 to `MAX_TIMESTAMP_MS` is a one-line error."""
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"timestamp": 3000, "input_length": 5, "hash_ids": [1]}\n'
        '{"input_length": 5, "hash_ids": [1]}\n'
        '{"timestamp": 1.5, "input_length": 5, "hash_ids": [1]}\n'
    )
    assert [r.timestamp for r in load_trace(path).requests] == [3.0, None, 0.0015]
    for bad in ('"soon"', "-1", "true", "1e400", "[1]"):
        path.write_text(f'{{"timestamp": {bad}, "input_length": 5, "hash_ids": [1]}}\n')
        with pytest.raises(TraceError, match=":1: timestamp must be milliseconds from 0 to "):
            load_trace(path)


def test_unreadable_traces(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "missing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(TraceError, match="has no requests"):
        load_trace(empty)
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(gzip.compress(b'{"input_length": 1, "hash_ids": [1]}\n')[:-6])
    with pytest.raises(TraceError, match="not a readable gzip file"):
        load_trace(broken)


class TestCommandLine:
    def small_trace(self, tmp_path: Path) -> Path:
        path = tmp_path / "small.jsonl"
        path.write_text(
            "".join(
                json.dumps({"input_length": 1024, "hash_ids": [i % 3, 100 + i]}) + "\n"
                for i in range(40)
            )
        )
        return path

    def test_table(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        assert main(["replay", str(self.small_trace(tmp_path)), "--capacity", "4,64"]) == 0
        out = capsys.readouterr()
        assert "40 requests, 80 block references" in out.out
        rows = [line.split() for line in out.out.splitlines()[2:]]
        assert [row[:2] for row in rows] == [
            ["lru", "4"],
            ["lru", "64"],
            ["arc", "4"],
            ["arc", "64"],
        ]
        assert all(row[3] == "-" for row in rows)  # no published figures for this trace
        assert out.err == ""  # no progress bar when standard error is not a terminal

    def test_json(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        trace = self.small_trace(tmp_path)
        assert main(["replay", str(trace), "--capacity", "64", "--policy", "lru", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        (row,) = report["results"]
        assert row["policy"] == "lru" and row["capacity_blocks"] == 64
        # The second half: every request hits block i % 3, 512 of its 1024 tokens.
        assert row["hit_rate"] == pytest.approx(0.5)
        assert row["reference_hit_rate"] is None

    def test_reference_column_for_the_known_trace(
        self, mooncake_trace: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        assert main(["replay", str(mooncake_trace), "--capacity", "1638", "--policy", "lru"]) == 0
        row = capsys.readouterr().out.splitlines()[2].split()
        assert row[:4] == ["lru", "1,638", "5.20%", "5.2%"]

    @pytest.mark.parametrize(
        ("args", "message"),
        [
            (["--capacity", "0"], "capacities must be positive"),
            (["--capacity", "lots"], "expected positive integers"),
            (["--capacity", "8", "--policy", "lfu"], "unknown eviction policy 'lfu'"),
            (["--capacity", "8", "--policy", ","], "expected names like 'lru,arc'"),
            ([], "the following arguments are required: --capacity"),
        ],
    )
    def test_bad_usage_exits_2(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
    ) -> None:
        with pytest.raises(SystemExit) as exit_info:
            code = main(["replay", str(self.small_trace(tmp_path)), *args])
            raise SystemExit(code)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err

    def test_malformed_trace_exits_1_with_one_line(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        path = tmp_path / "bad.jsonl"
        path.write_text('{"input_length": 5, "hash_ids": [1]}\n{"input_length": 5}\n')
        assert main(["replay", str(path), "--capacity", "8"]) == 1
        err = capsys.readouterr().err
        assert err == f"kvtier replay: error: {path}:2: missing field 'hash_ids'\n"

    def test_console_script(self, tmp_path: Path) -> None:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvtier",
                "replay",
                str(self.small_trace(tmp_path)),
                "--capacity",
                "64",
                "--policy",
                "arc",
                "--json",
            ],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        )
        assert json.loads(out.stdout)["results"][0]["hit_rate"] == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"input_length": ' + "9" * 5000 + ', "hash_ids": []}', "not a trace line"),
        ("[" * 100_000 + "]" * 100_000, "not a trace line"),
    ],
    ids=["an integer of 5,000 digits", "100,000 levels of nesting"],
)
def test_lines_json_cannot_hold_are_one_line_errors(
    tmp_path: Path, line: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(TraceError, match=f"t.jsonl:1: {message}"):
        load_trace(path)
    assert main(["replay", str(path), "--capacity", "10"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_reading_a_trace_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A device with no end and a gzip bomb are refused once past the bound, not read whole."""
    import kvtier.trace

    monkeypatch.setattr(kvtier.trace, "MAX_TRACE_BYTES", 1 << 20)
    with pytest.raises(TraceError, match="larger than 1 MiB"):
        load_trace("/dev/zero")
    bomb = tmp_path / "bomb.jsonl.gz"
    bomb.write_bytes(gzip.compress(bytes(64 << 20)))
    with pytest.raises(TraceError, match="larger than 1 MiB"):
        load_trace(bomb)
