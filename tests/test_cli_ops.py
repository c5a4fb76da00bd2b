"""The operator commands against real tiers: a directory, Redis and SeaweedFS."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from kvtier.cli import main
from kvtier.servers import RedisServer, SeaweedS3
from tests.conftest import ROOT
from tiering.keys import BlockKey, make_key
from tiering.testing import payload
from tiers.file import FileTier
from tiers.redis import RedisTier
from tiers.s3 import S3Tier

pytestmark = [pytest.mark.redis, pytest.mark.s3]
NS = bytes(range(40, 56))
SIZE = 8192


def k(i: int) -> BlockKey:
    return make_key(i.to_bytes(32, "big"))


@pytest.fixture
def setup(tmp_path: Path, redis_server: RedisServer, s3_server: SeaweedS3) -> dict[str, Any]:
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
""".replace('password: "${NOT_NEEDED:-}"', "password: null")
    )
    return {
        "config": config,
        "tmp": tmp_path,
        "redis": redis_server,
        "s3": s3_server,
        "prefix": prefix,
    }


def fill(setup: dict[str, Any], n: int, name: str = "nvme") -> None:
    async def go() -> None:
        async with FileTier(namespace=NS, path=setup["tmp"] / name, min_free=0) as tier:
            await tier.put_many([(k(i), payload(SIZE, i)) for i in range(n)])

    asyncio.run(go())


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def blocks(tier: Any, n: int) -> list[bytes | None]:
    async def go() -> list[bytes | None]:
        async with tier:
            return [await tier.get_bytes(k(i), SIZE) for i in range(n)]

    return asyncio.run(go())


def test_validate_and_show(setup: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "validate", "--config", str(setup["config"]))
    assert code == 0 and "valid" in out and "nvme (file, write back)" in out
    secret = setup["tmp"] / "secret.yaml"
    secret.write_text(
        "tiers: [{name: r, type: redis, url: 'redis://127.0.0.1:1', password: hunter2}]\n"
    )
    code, out, _ = run(capsys, "show", "--config", str(secret), "--json")
    shown = json.loads(out)
    assert code == 0 and shown["tiers"][0]["options"]["password"] == "***" and "hunter2" not in out


def test_migrate_round_trip_is_bit_exact(
    setup: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    fill(setup, 30)
    config = str(setup["config"])
    for source, destination in (("nvme", "s3"), ("s3", "redis"), ("redis", "back")):
        code, out, err = run(
            capsys,
            "migrate",
            "--config",
            config,
            "--from",
            source,
            "--to",
            destination,
            "--verify",
            "--json",
        )
        summary = json.loads(out)
        assert code == 0, err
        assert (summary["copied"], summary["failed"], summary["planned"]) == (30, 0, 30), (
            source,
            summary,
        )
    back = FileTier(namespace=NS, path=setup["tmp"] / "back", min_free=0)
    assert blocks(back, 30) == [payload(SIZE, i) for i in range(30)]


def test_move_deletes_the_source_only_after_a_verified_copy(
    setup: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    fill(setup, 10)
    code, out, _ = run(
        capsys,
        "migrate",
        "--config",
        str(setup["config"]),
        "--from",
        "nvme",
        "--to",
        "redis",
        "--move",
        "--json",
    )
    assert code == 0 and json.loads(out)["moved"] == 10
    assert blocks(FileTier(namespace=NS, path=setup["tmp"] / "nvme", min_free=0), 10) == [None] * 10
    assert blocks(RedisTier(namespace=NS, url=setup["redis"].url), 10) == [
        payload(SIZE, i) for i in range(10)
    ]


def test_dry_run_copies_nothing(setup: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    fill(setup, 5)
    code, out, _ = run(
        capsys,
        "migrate",
        "--config",
        str(setup["config"]),
        "--from",
        "nvme",
        "--to",
        "redis",
        "--dry-run",
    )
    assert code == 0 and "would copy 5 blocks" in out
    assert blocks(RedisTier(namespace=NS, url=setup["redis"].url), 5) == [None] * 5


def test_a_killed_migration_resumes_without_copying_again(setup: dict[str, Any]) -> None:
    total = 300
    fill(setup, total)
    journal = setup["tmp"] / "journal"
    command = [
        sys.executable,
        "-m",
        "kvtier",
        "migrate",
        "--config",
        str(setup["config"]),
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
    s3 = S3Tier(
        namespace=NS,
        bucket=setup["s3"].bucket,
        prefix=setup["prefix"],
        endpoint_url=setup["s3"].endpoint,
        access_key=setup["s3"].ACCESS_KEY,
        secret_key=setup["s3"].SECRET_KEY,
    )
    assert blocks(s3, total) == [payload(SIZE, i) for i in range(total)]


def test_verify_finds_planted_corruption_and_repair_removes_it(
    setup: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    fill(setup, 6)
    tier = FileTier(namespace=NS, path=setup["tmp"] / "nvme", min_free=0)
    damaged = tier.raw_path(k(2))
    raw = bytearray(damaged.read_bytes())
    raw[-1] ^= 0xFF
    damaged.write_bytes(raw)
    code, out, _ = run(
        capsys, "verify", "--config", str(setup["config"]), "--tier", "nvme", "--json"
    )
    report = json.loads(out)
    assert code == 1 and report["checked"] == 6 and report["ok"] == 5
    assert report["bad"] == [[k(2).hex(), "checksum"]]
    assert damaged.exists()  # without --repair, nothing is deleted
    code, out, _ = run(
        capsys, "verify", "--config", str(setup["config"]), "--tier", "nvme", "--repair"
    )
    assert code == 0 and "1 deleted" in out and not damaged.exists()


def test_stats_ls_inspect_purge(setup: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    fill(setup, 4)
    config = str(setup["config"])
    code, out, _ = run(capsys, "stats", "--config", config, "--tier", "nvme", "--json")
    (row,) = json.loads(out)
    assert code == 0 and row["namespace"] == NS.hex() and row["objects"] == 4
    code, out, _ = run(capsys, "ls", "--config", config, "--tier", "nvme", "--json", "--limit", "3")
    listed = json.loads(out)
    assert len(listed) == 3 and all(
        r["block_bytes"] == SIZE and r["codec"] == "raw" for r in listed
    )
    code, out, _ = run(capsys, "inspect", "--config", config, "--tier", "nvme", k(1).hex())
    assert code == 0 and "verified: True" in out and f"block_bytes: {SIZE}" in out
    code, out, _ = run(
        capsys, "purge", "--config", config, "--tier", "nvme", "--namespace", NS.hex(), "--yes"
    )
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
        (["purge", "--tier", "nvme", "--yes"], "purge: give --namespace or --older-than"),
        (["migrate", "--from", "nvme", "--to", "nvme"], "--from and --to name the same tier"),
        (
            ["migrate", "--from", "nvme", "--to", "redis", "--older-than", "soon"],
            "--older-than: expected a duration",
        ),
        (
            ["inspect", "--tier", "nvme", "--namespace", NS.hex(), "not-a-key"],
            "is not lowercase hex",
        ),
    ],
)
def test_bad_usage_exits_2_with_one_line(
    setup: dict[str, Any], capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as info:
        raise SystemExit(main([args[0], "--config", str(setup["config"]), *args[1:]]))
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err
    assert len([line for line in err.splitlines() if "error" in line]) == 1


def test_bad_config_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers: [{name: a, type: file}]\n")
    assert main(["validate", "--config", str(bad)]) == 2
    assert capsys.readouterr().err == (
        f"kvtier validate: error: {bad}: tiers[0].path: missing (a file tier needs it)\n"
    )


def test_bench_against_the_raw_baseline(
    setup: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(
        capsys,
        "bench",
        "--config",
        str(setup["config"]),
        "--tier",
        "redis",
        "--sizes",
        "64KiB",
        "--count",
        "32",
        "--json",
    )
    (row,) = json.loads(out)
    assert code == 0 and row["baseline"] == "redis-benchmark"
    assert row["put_gib_s"] > 0 and row["raw_read_gib_s"] > 0 and row["get_ratio"] > 0
    assert blocks(RedisTier(namespace=bytes(range(200, 216)), url=setup["redis"].url), 1) == [None]


def test_inspection_commands_read_a_live_segment_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """stats, ls and inspect open tiers read-only: they work on a segment-layout directory that
    a running engine holds (one writer per directory), and find what it wrote."""
    config = tmp_path / "tiers.yaml"
    root = tmp_path / "live"
    config.write_text(
        f"""
version: 1
primary: {{capacity: 1GiB}}
tiers:
  - {{name: nvme, type: file, path: "{root}", min_free: 0, layout: segments}}
"""
    )

    async def live() -> None:
        writer = FileTier(namespace=NS, path=root, min_free=0, layout="segments")
        async with writer:
            await writer.put_many([(k(i), payload(SIZE, i)) for i in range(3)])
            for command in (
                ["stats", "--tier", "nvme", "--json"],
                ["ls", "--tier", "nvme", "--json"],
                ["inspect", "--tier", "nvme", k(1).hex()],
            ):
                code = await asyncio.to_thread(
                    main, [command[0], "--config", str(config), *command[1:]]
                )
                assert code == 0, (command, capsys.readouterr().err)
                out = capsys.readouterr().out
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
    config = tmp_path / "disks.yaml"
    config.write_text(
        f"tiers:\n"
        f"  - {{name: a, type: file, path: '{tmp_path / 'a'}', min_free: 0}}\n"
        f"  - {{name: b, type: file, path: '{tmp_path / 'b'}', min_free: 0}}\n"
    )

    async def go() -> None:
        async with FileTier(namespace=NS, path=tmp_path / "a", min_free=0) as tier:
            await tier.put_many([(k(i), payload(SIZE, i)) for i in range(5)])

    asyncio.run(go())
    return config


def migrate_to_b(config: Path, *extra: str) -> list[str]:
    return ["migrate", "--config", str(config), "--from", "a", "--to", "b", *extra]


def test_a_journal_path_that_is_not_a_journal_is_refused_untouched(
    two_disks: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
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
        code, out, err = run(capsys, *migrate_to_b(two_disks, "--journal", str(journal)))
        assert code == 2 and out == "" and message in err, err
        assert err.count("\n") == 1
    assert notes.read_text() == "my notes\n"
    assert blocks(FileTier(namespace=NS, path=tmp_path / "b", min_free=0), 5) == [None] * 5


def test_a_journal_names_its_migration_and_another_one_is_refused(
    two_disks: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    journal = tmp_path / "a-to-b.journal"
    code, _, err = run(capsys, *migrate_to_b(two_disks, "--journal", str(journal), "--json"))
    assert code == 0, err
    header, *done = journal.read_text().splitlines()
    assert header == f"# kvtier migration journal v1 a -> b {NS.hex()}"
    assert sorted(done) == sorted(k(i).hex() for i in range(5))
    code, out, _ = run(capsys, *migrate_to_b(two_disks, "--journal", str(journal), "--resume"))
    assert code == 0 and "skipped 5" in out
    code, out, err = run(
        capsys,
        "migrate",
        "--config",
        str(two_disks),
        "--from",
        "b",
        "--to",
        "a",
        "--journal",
        str(journal),
    )
    assert code == 2 and "the journal of another migration (a -> b" in err
    assert journal.read_text().splitlines()[0] == header  # left as it was
    empty = tmp_path / "empty.journal"
    empty.touch()  # nothing to lose: taken
    assert run(capsys, *migrate_to_b(two_disks, "--journal", str(empty)))[0] == 0


def test_the_default_journal_is_in_the_test_home(
    two_disks: Path, test_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No test writes to the user's home: HOME points at the session's own (conftest), and a
    migration's default journal lands there."""
    from tests.conftest import REAL_HOME

    real = REAL_HOME / ".cache" / "kvtier" / "migrations"
    before = sorted(real.iterdir()) if real.is_dir() else []
    assert Path.home() == test_home and test_home != REAL_HOME
    assert not Path(os.environ["KVTIER_VLLM_VENV"]).is_relative_to(test_home)  # the real one
    code, out, _ = run(capsys, *migrate_to_b(two_disks, "--json"))
    journal = Path(json.loads(out)["journal"])
    assert code == 0 and journal.is_relative_to(test_home / ".cache" / "kvtier" / "migrations")
    assert journal.read_text().startswith("# kvtier migration journal v1 a -> b")
    assert (sorted(real.iterdir()) if real.is_dir() else []) == before


def test_purge_at_the_end_of_input_deletes_nothing(
    two_disks: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    purge = ["purge", "--config", str(two_disks), "--tier", "a", "--namespace", NS.hex()]
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # end of input: no answer is no
    code, out, err = run(capsys, *purge)
    assert code == 1 and out == "" and "[y/N] \nkvtier purge: nothing deleted\n" in err
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))
    code, out, err = run(capsys, *purge)
    assert code == 0 and "deleted 5 blocks" in out and "[y/N]" in err


def test_show_masks_the_auth_secret_and_every_tier_gets_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "kvtier-test-secret-0123456789"
    monkeypatch.setenv("KVTIER_TEST_SECRET", secret)
    config = tmp_path / "auth.yaml"
    config.write_text(
        "auth: {secret: '${KVTIER_TEST_SECRET}'}\n"
        f"tiers: [{{name: a, type: file, path: '{tmp_path / 'a'}', min_free: 0}}]\n"
    )
    for extra in ([], ["--json"]):
        code, out, err = run(capsys, "show", "--config", str(config), *extra)
        assert code == 0 and secret not in out + err and "***" in out
    code, out, _ = run(capsys, "validate", "--config", str(config))
    assert code == 0 and "authenticated objects" in out

    async def plant() -> None:  # a block written without the secret: a stranger's
        async with FileTier(namespace=NS, path=tmp_path / "a", min_free=0) as tier:
            await tier.put(k(1), payload(SIZE, 1))

    asyncio.run(plant())
    code, out, _ = run(capsys, "verify", "--config", str(config), "--tier", "a", "--json")
    assert code == 1 and json.loads(out)["bad"] == [[k(1).hex(), "auth"]]
