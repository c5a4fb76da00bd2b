"""The operator commands against real tiers: a directory, Redis and SeaweedFS."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from kvtier.cli import main
from kvtier.servers import RedisServer, SeaweedS3
from tests.helpers.paths import ROOT
from tiering.keys import BlockKey, make_key
from tiering.testing import payload
from tiering.tier import Tier
from tiers.file import BlockFileTier, SegmentFileTier
from tiers.redis import RedisTier
from tiers.s3 import S3Tier

pytestmark = [pytest.mark.redis, pytest.mark.s3]
NS = bytes(range(40, 56))
SIZE = 8192

Output = tuple[int, str, str]
"""What a command did: its exit code, its standard output and its standard error."""


def k(i: int) -> BlockKey:
    return make_key(i.to_bytes(32, "big"))


def file_tier(path: Path) -> BlockFileTier:
    return BlockFileTier(namespace=NS, path=path, min_free=0)


def fill(path: Path, n: int) -> None:
    """Blocks 0 to n - 1 of namespace NS in the file tier at `path`."""

    async def go() -> None:
        async with file_tier(path) as tier:
            await tier.put_many([(k(i), payload(SIZE, i)) for i in range(n)])

    asyncio.run(go())


def blocks(tier: Tier, n: int) -> list[bytes | None]:
    """What `tier` holds of blocks 0 to n - 1."""

    async def go() -> list[bytes | None]:
        async with tier:
            return [await tier.get_bytes(k(i), SIZE) for i in range(n)]

    return asyncio.run(go())


def expected(n: int) -> list[bytes | None]:
    return [payload(SIZE, i) for i in range(n)]


class Cli:
    """`kvtier` run in the test's process and thread, its output captured."""

    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self.capsys = capsys

    def __call__(self, *args: str) -> Output:
        code = main(list(args))
        out = self.capsys.readouterr()
        return code, out.out, out.err

    def on(self, config: Path, command: str, *args: str) -> Output:
        """`kvtier COMMAND --config CONFIG ARGS...`."""
        return self(command, "--config", str(config), *args)


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Cli:
    return Cli(capsys)


@dataclass(frozen=True)
class Setup:
    """A config of four tiers: `nvme` and `back` (directories), `redis` and `s3` (the session's
    servers, emptied: Redis flushed, S3 under a prefix of its own)."""

    config: Path
    tmp: Path
    redis: RedisServer
    s3: SeaweedS3
    prefix: str

    def fill(self, n: int, name: str = "nvme") -> None:
        fill(self.tmp / name, n)

    def file_tier(self, name: str) -> BlockFileTier:
        return file_tier(self.tmp / name)

    def redis_tier(self, namespace: bytes = NS) -> RedisTier:
        return RedisTier(namespace=namespace, url=self.redis.url)

    def s3_tier(self) -> S3Tier:
        return S3Tier(
            namespace=NS,
            bucket=self.s3.bucket,
            prefix=self.prefix,
            endpoint_url=self.s3.endpoint,
            access_key=self.s3.ACCESS_KEY,
            secret_key=self.s3.SECRET_KEY,
        )


@pytest.fixture
def setup(tmp_path: Path, redis_server: RedisServer, s3_server: SeaweedS3) -> Setup:
    client = redis.Redis(host="127.0.0.1", port=redis_server.port)
    client.flushall()
    client.close()
    prefix = f"cli-{time.monotonic_ns()}/"
    config = tmp_path / "tiers.yaml"
    config.write_text(
        f"""
version: 1
primary: {{capacity: 1GiB}}
tiers:
  - {{name: nvme, type: file, path: "{tmp_path / "nvme"}", min_free: 0}}
  - {{name: redis, type: redis, url: "{redis_server.url}"}}
  - {{name: s3, type: s3, bucket: {s3_server.bucket}, prefix: {prefix},
     endpoint_url: "{s3_server.endpoint}",
     access_key: {s3_server.ACCESS_KEY}, secret_key: {s3_server.SECRET_KEY}}}
  - {{name: back, type: file, path: "{tmp_path / "back"}", min_free: 0}}
"""
    )
    return Setup(config, tmp_path, redis_server, s3_server, prefix)


def file_tiers_config(path: Path, *names: str, extra: str = "", layout: str = "files") -> Path:
    """A config of file tiers named `names`, each in the directory of its name beside `path`
    (`extra`: more top-level YAML, before the tiers)."""
    tiers = "".join(
        f"  - {{name: {name}, type: file, path: '{path.parent / name}', min_free: 0"
        + (f", layout: {layout}" if layout != "files" else "")
        + "}\n"
        for name in names
    )
    path.write_text(f"{extra}tiers:\n{tiers}")
    return path


def test_validate_and_show(setup: Setup, cli: Cli) -> None:
    code, out, _ = cli.on(setup.config, "validate")
    assert code == 0 and "valid" in out and "nvme (file, write back)" in out
    secret = setup.tmp / "secret.yaml"
    secret.write_text(
        "tiers: [{name: r, type: redis, url: 'redis://127.0.0.1:1', password: hunter2}]\n"
    )
    code, out, _ = cli.on(secret, "show", "--json")
    shown = json.loads(out)
    assert code == 0 and shown["tiers"][0]["options"]["password"] == "***" and "hunter2" not in out


def test_migrate_round_trip_is_bit_exact(setup: Setup, cli: Cli) -> None:
    setup.fill(30)
    for source, destination in (("nvme", "s3"), ("s3", "redis"), ("redis", "back")):
        code, out, err = cli.on(
            setup.config, "migrate", "--from", source, "--to", destination, "--verify", "--json"
        )
        summary = json.loads(out)
        assert code == 0, err
        assert (summary["copied"], summary["failed"], summary["planned"]) == (30, 0, 30), (
            source,
            summary,
        )
    assert blocks(setup.file_tier("back"), 30) == expected(30)


def test_move_deletes_the_source_only_after_a_verified_copy(setup: Setup, cli: Cli) -> None:
    setup.fill(10)
    code, out, _ = cli.on(
        setup.config, "migrate", "--from", "nvme", "--to", "redis", "--move", "--json"
    )
    assert code == 0 and json.loads(out)["moved"] == 10
    assert blocks(setup.file_tier("nvme"), 10) == [None] * 10
    assert blocks(setup.redis_tier(), 10) == expected(10)


def test_dry_run_copies_nothing(setup: Setup, cli: Cli) -> None:
    setup.fill(5)
    code, out, _ = cli.on(setup.config, "migrate", "--from", "nvme", "--to", "redis", "--dry-run")
    assert code == 0 and "would copy 5 blocks" in out
    assert blocks(setup.redis_tier(), 5) == [None] * 5


def test_a_killed_migration_resumes_without_copying_again(setup: Setup) -> None:
    total = 300
    setup.fill(total)
    journal = setup.tmp / "journal"
    command = [
        sys.executable,
        "-m",
        "kvtier",
        "migrate",
        "--config",
        str(setup.config),
        "--from",
        "nvme",
        "--to",
        "s3",
        "--journal",
        str(journal),
        "--concurrency",
        "2",
    ]
    with subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as proc:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if journal.exists() and len(journal.read_text().splitlines()) > 40:  # header too
                break
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    header, *lines = journal.read_text().splitlines()
    assert header.startswith("# kvtier migration journal v1 nvme -> s3")
    finished = set(lines)
    assert 40 <= len(finished) < total, "killed too late to test resuming"
    resumed = subprocess.run(
        command + ["--resume", "--json"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    summary = json.loads(resumed.stdout)
    assert summary["skipped"] >= len(finished)  # finished blocks were not copied again
    assert summary["copied"] + summary["skipped"] == total and summary["failed"] == 0
    assert blocks(setup.s3_tier(), total) == expected(total)


def test_verify_finds_planted_corruption_and_repair_removes_it(setup: Setup, cli: Cli) -> None:
    setup.fill(6)
    damaged = setup.file_tier("nvme")._path(k(2))
    raw = bytearray(damaged.read_bytes())
    raw[-1] ^= 0xFF
    damaged.write_bytes(raw)
    code, out, _ = cli.on(setup.config, "verify", "--tier", "nvme", "--json")
    report = json.loads(out)
    assert code == 1 and report["checked"] == 6 and report["ok"] == 5
    assert report["bad"] == [[k(2).hex(), "checksum"]]
    assert damaged.exists()  # without --repair, nothing is deleted
    code, out, _ = cli.on(setup.config, "verify", "--tier", "nvme", "--repair")
    assert code == 0 and "1 deleted" in out and not damaged.exists()


def test_stats_ls_inspect_purge(setup: Setup, cli: Cli) -> None:
    setup.fill(4)
    code, out, _ = cli.on(setup.config, "stats", "--tier", "nvme", "--json")
    (row,) = json.loads(out)
    assert code == 0 and row["namespace"] == NS.hex() and row["objects"] == 4
    code, out, _ = cli.on(setup.config, "ls", "--tier", "nvme", "--json", "--limit", "3")
    listed = json.loads(out)
    assert len(listed) == 3 and all(
        r["block_bytes"] == SIZE and r["codec"] == "raw" for r in listed
    )
    code, out, _ = cli.on(setup.config, "inspect", "--tier", "nvme", k(1).hex())
    assert code == 0 and "verified: True" in out and f"block_bytes: {SIZE}" in out
    code, out, _ = cli.on(setup.config, "purge", "--tier", "nvme", "--namespace", NS.hex(), "--yes")
    assert code == 0 and "deleted 4 blocks" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["migrate", "--from", "nvme"], "the following arguments are required: --to"),
        (
            ["ls", "--tier", "nowhere"],
            "no tier named 'nowhere' in the config; tiers: nvme, redis, s3, back",
        ),
        (["ls", "--tier", "nvme", "--namespace", "xyz"], "--namespace: expected 32 hex digits"),
        (
            ["purge", "--tier", "nvme", "--yes"],
            "purge: give --namespace, --older-than or --idle-for",
        ),
        (["migrate", "--from", "nvme", "--to", "nvme"], "--from and --to name the same tier"),
        (
            ["migrate", "--from", "nvme", "--to", "redis", "--older-than", "soon"],
            "--older-than: expected a duration",
        ),
        (
            ["inspect", "--tier", "nvme", "--namespace", NS.hex(), "not-a-key"],
            "is not lowercase hex",
        ),
        (
            ["migrate", "--from", "nvme", "--to", "back", "--concurrency", "٣"],
            "expected an integer from 1 to 1,024, got '٣'",
        ),
        (
            ["migrate", "--from", "nvme", "--to", "back", "--older-than", "٣d"],
            "--older-than: expected a duration",
        ),
    ],
)
def test_bad_usage_exits_2_with_one_line(
    setup: Setup, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as info:
        raise SystemExit(main([args[0], "--config", str(setup.config), *args[1:]]))
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err
    assert len([line for line in err.splitlines() if "error" in line]) == 1


def test_bad_config_exits_2(tmp_path: Path, cli: Cli) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers: [{name: a, type: file}]\n")
    code, _, err = cli.on(bad, "validate")
    assert code == 2
    assert err == f"kvtier validate: error: {bad}: tiers[0].path: missing (a file tier needs it)\n"


def test_bench_against_the_raw_baseline(setup: Setup, cli: Cli) -> None:
    code, out, _ = cli.on(
        setup.config, "bench", "--tier", "redis", "--sizes", "64KiB", "--count", "32", "--json"
    )
    (row,) = json.loads(out)
    assert code == 0 and row["baseline"] == "redis-benchmark"
    assert row["put_gib_s"] > 0 and row["raw_read_gib_s"] > 0 and row["get_ratio"] > 0
    assert blocks(setup.redis_tier(bytes(range(200, 216))), 1) == [None]


def test_inspection_commands_read_a_live_segment_directory(tmp_path: Path, cli: Cli) -> None:
    """stats, ls and inspect open tiers read-only: they work on a segment-layout directory that
    a running engine holds (one writer per directory), and find what it wrote."""
    config = file_tiers_config(
        tmp_path / "tiers.yaml",
        "live",
        extra="version: 1\nprimary: {capacity: 1GiB}\n",
        layout="segments",
    )

    async def live() -> None:
        writer = SegmentFileTier(namespace=NS, path=tmp_path / "live", min_free=0)
        async with writer:
            await writer.put_many([(k(i), payload(SIZE, i)) for i in range(3)])
            for command in (
                ["stats", "--tier", "live", "--json"],
                ["ls", "--tier", "live", "--json"],
                ["inspect", "--tier", "live", k(1).hex()],
            ):
                code, out, err = await asyncio.to_thread(cli.on, config, *command)
                assert code == 0, (command, err)
                if command[0] == "stats":
                    assert json.loads(out)[0]["objects"] == 3
                elif command[0] == "ls":
                    assert len(json.loads(out)) == 3
                else:
                    assert "verified: True" in out
            assert await writer.get_bytes(k(2), SIZE) == payload(SIZE, 2)  # still the writer

    asyncio.run(live())


# -- journals, prompts and the test home (issue 15, items 11 and 12) ------------------------------


@pytest.fixture
def two_disks(tmp_path: Path) -> Path:
    """A config of two file tiers, `a` holding five blocks."""
    config = file_tiers_config(tmp_path / "disks.yaml", "a", "b")
    fill(tmp_path / "a", 5)
    return config


def migrate_to_b(config: Path, *extra: str) -> list[str]:
    return ["migrate", "--config", str(config), "--from", "a", "--to", "b", *extra]


def test_a_journal_path_that_is_not_a_journal_is_refused_untouched(
    two_disks: Path, tmp_path: Path, cli: Cli
) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    for journal, message in (
        (notes, "not a kvtier migration journal (its first line is not '# kvtier migration"),
        (tmp_path, "is a directory; give a file name"),
        (Path("/"), "journal /: is a directory"),
        (Path("/dev/null"), "journal /dev/null: not a regular file"),
        (notes / "sub", "Not a directory"),
    ):
        code, out, err = cli(*migrate_to_b(two_disks, "--journal", str(journal)))
        assert code == 2 and out == "" and message in err, err
        assert err.count("\n") == 1
    assert notes.read_text() == "my notes\n"
    assert blocks(file_tier(tmp_path / "b"), 5) == [None] * 5


def test_a_journal_names_its_migration_and_another_one_is_refused(
    two_disks: Path, tmp_path: Path, cli: Cli
) -> None:
    journal = tmp_path / "a-to-b.journal"
    code, _, err = cli(*migrate_to_b(two_disks, "--journal", str(journal), "--json"))
    assert code == 0, err
    header, *done = journal.read_text().splitlines()
    assert header == f"# kvtier migration journal v1 a -> b {NS.hex()}"
    assert sorted(done) == sorted(k(i).hex() for i in range(5))
    code, out, _ = cli(*migrate_to_b(two_disks, "--journal", str(journal), "--resume"))
    assert code == 0 and "skipped 5" in out
    code, out, err = cli.on(
        two_disks, "migrate", "--from", "b", "--to", "a", "--journal", str(journal)
    )
    assert code == 2 and "the journal of another migration (a -> b" in err
    assert journal.read_text().splitlines()[0] == header  # left as it was
    empty = tmp_path / "empty.journal"
    empty.touch()  # nothing to lose: taken
    assert cli(*migrate_to_b(two_disks, "--journal", str(empty)))[0] == 0


def test_the_default_journal_is_in_the_test_home(
    two_disks: Path, test_home: Path, cli: Cli
) -> None:
    """No test writes to the user's home: HOME points at the session's own (conftest), and a
    migration's default journal lands there."""
    from tests.helpers.paths import REAL_HOME

    real = REAL_HOME / ".cache" / "kvtier" / "migrations"
    before = sorted(real.iterdir()) if real.is_dir() else []
    assert Path.home() == test_home and test_home != REAL_HOME
    assert not Path(os.environ["KVTIER_VLLM_VENV"]).is_relative_to(test_home)  # the real one
    code, out, _ = cli(*migrate_to_b(two_disks, "--json"))
    journal = Path(json.loads(out)["journal"])
    assert code == 0 and journal.is_relative_to(test_home / ".cache" / "kvtier" / "migrations")
    assert journal.read_text().startswith("# kvtier migration journal v1 a -> b")
    assert (sorted(real.iterdir()) if real.is_dir() else []) == before


def test_purge_at_the_end_of_input_deletes_nothing(
    two_disks: Path, cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    purge = ["purge", "--tier", "a", "--namespace", NS.hex()]
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # end of input: no answer is no
    code, out, err = cli.on(two_disks, *purge)
    assert code == 1 and out == "" and "[y/N] \nkvtier purge: nothing deleted\n" in err
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))
    code, out, err = cli.on(two_disks, *purge)
    assert code == 0 and "deleted 5 blocks" in out and "[y/N]" in err


def test_show_masks_the_auth_secret_and_every_tier_gets_it(
    tmp_path: Path, cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "kvtier-test-secret-0123456789"
    monkeypatch.setenv("KVTIER_TEST_SECRET", secret)
    config = file_tiers_config(
        tmp_path / "auth.yaml", "a", extra="auth: {secret: '${KVTIER_TEST_SECRET}'}\n"
    )
    for extra in ([], ["--json"]):
        code, out, err = cli.on(config, "show", *extra)
        assert code == 0 and secret not in out + err and "***" in out
    code, out, _ = cli.on(config, "validate")
    assert code == 0 and "authenticated objects" in out

    async def plant() -> None:  # a block written without the secret: a stranger's
        async with file_tier(tmp_path / "a") as tier:
            await tier.put(k(1), payload(SIZE, 1))

    asyncio.run(plant())
    code, out, _ = cli.on(config, "verify", "--tier", "a", "--json")
    assert code == 1 and json.loads(out)["bad"] == [[k(1).hex(), "auth"]]
