"""`kvtier verify --repair` beside another secret's engine, on a `files` directory and a real
redis-server: it deletes only what is provably damaged, never what another secret can read."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from kvtier.cli import main
from kvtier.servers import RedisServer
from tiering.keys import BlockKey, make_key, store_namespace
from tiering.testing import payload
from tiers.file import BlockFileTier
from tiers.redis import RedisTier

pytestmark = pytest.mark.redis

NS = bytes(range(70, 86))
SIZE = 8192
BLOCKS = 20
OWNER = b"the-owners-secret-0123456789"
OTHER = b"an-operators-old-secret-98765"


def k(i: int) -> BlockKey:
    return make_key(i.to_bytes(32, "big"))


class Medium:
    """One store: the owner's tier over it, with or without its secret, a raw way to damage
    one object, and the YAML entry an operator's config names it by."""

    def __init__(self, kind: str, tmp: Path, server: RedisServer) -> None:
        self.kind = kind
        self.path = tmp / "nvme"
        self.url = server.url
        if kind == "files":
            self.entry: dict[str, Any] = {
                "name": "t",
                "type": "file",
                "path": str(self.path),
                "min_free": 0,
            }
        else:
            self.entry = {"name": "t", "type": "redis", "url": server.url}

    def tier(self, secret: bytes | None, namespace: bytes = NS) -> Any:
        if self.kind == "files":
            return BlockFileTier(namespace=namespace, path=self.path, min_free=0, secret=secret)
        return RedisTier(namespace=namespace, url=self.url, secret=secret)

    def write(
        self, secret: bytes | None, namespace: bytes = NS, blocks: range = range(BLOCKS)
    ) -> None:
        async def go() -> None:
            async with self.tier(secret, namespace) as tier:
                await tier.put_many([(k(i), payload(SIZE, i)) for i in blocks])

        asyncio.run(go())

    def found(self, secret: bytes | None, namespace: bytes = NS) -> int:
        """How many of the owner's blocks a reader with `secret` gets back, exact."""

        async def go() -> int:
            async with self.tier(secret, namespace) as tier:
                got = [await tier.get_bytes(k(i), SIZE) for i in range(BLOCKS)]
            return sum(g == payload(SIZE, i) for i, g in enumerate(got))

        return asyncio.run(go())

    def damage(self, i: int) -> None:
        """Flip the last payload byte of block `i` behind the tier's back: provable damage."""
        tier = self.tier(None)
        if self.kind == "files":
            path = tier._path(k(i))
            raw = bytearray(path.read_bytes())
            raw[-1] ^= 0xFF
            path.write_bytes(raw)
            return
        client = redis.Redis.from_url(self.url)
        name = tier._name(k(i))
        raw = bytearray(client.get(name))
        raw[-1] ^= 0xFF
        client.set(name, bytes(raw))
        client.close()


@pytest.fixture(params=["files", "redis"])
def medium(
    request: pytest.FixtureRequest, tmp_path: Path, redis_server: RedisServer
) -> Iterator[Medium]:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield Medium(request.param, tmp_path, redis_server)
    client.flushall()
    client.close()


def verify(
    medium: Medium,
    tmp: Path,
    secret: bytes | None,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    *extra: str,
) -> tuple[int, dict[str, Any], str]:
    """`kvtier verify --tier t --repair EXTRA --json` from an operator's shell holding
    `secret` (or none); its exit code, its report and its table."""
    doc: dict[str, Any] = {"tiers": [medium.entry]}
    if secret is not None:
        monkeypatch.setenv("KVTIER_OPERATOR_SECRET", secret.decode())
        doc["auth"] = {"secret": "${KVTIER_OPERATOR_SECRET}"}
    config = tmp / "operator.yaml"
    config.write_text(json.dumps(doc))
    base = ["verify", "--config", str(config), "--tier", "t", "--repair", *extra]
    code = main([*base, "--json"])
    report = json.loads(capsys.readouterr().out)
    main(base)
    return code, report, capsys.readouterr().out


@pytest.mark.parametrize(
    ("owner", "operator"),
    [(OWNER, OTHER), (None, OWNER)],
    ids=["another-secret", "owner-without-secret"],
)
def test_repair_with_another_secret_leaves_every_block_the_owner_reads(
    medium: Medium,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    owner: bytes | None,
    operator: bytes,
) -> None:
    """The owner's 20 blocks, one of them then damaged on the medium: a repair by a shell
    with another secret deletes the damaged one (its checksum proves it, whoever reads) and
    leaves the 19 it cannot authenticate, saying why; the owner still reads all 19."""
    medium.write(owner)
    medium.damage(7)
    code, report, table = verify(medium, tmp_path, operator, capsys, monkeypatch)
    assert report["checked"] == BLOCKS and report["ok"] == 0 and len(report["bad"]) == BLOCKS
    assert report["repaired"] == 1 and [k(7).hex(), "checksum"] in report["bad"]
    assert len(report["left"]) == BLOCKS - 1
    assert {reason for _, reason in report["left"]} == {"auth"}
    assert code == 1  # objects this reader cannot use are still there
    assert "0 deleted, 19 left" in table  # the second run found the damaged one gone
    assert "left in place" in table and "19 fail authentication" in table
    assert "--delete-unauthenticated" in table
    assert medium.found(owner) == BLOCKS - 1


def test_repair_without_a_secret_deletes_nothing_the_owner_reads(
    medium: Medium,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A shell with no secret checks the owner's objects by their checksums (it cannot check
    a MAC): all 20 are fine and stay."""
    medium.write(OWNER)
    code, report, table = verify(medium, tmp_path, None, capsys, monkeypatch)
    assert code == 0 and report["ok"] == BLOCKS and report["repaired"] == 0
    assert "0 deleted, 0 left" in table
    assert medium.found(OWNER) == BLOCKS


def test_delete_unauthenticated_is_the_operators_explicit_word(
    medium: Medium,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only with `--delete-unauthenticated` does a repair delete what fails authentication;
    without `--repair` the option is refused with one line, exit 2."""
    medium.write(OTHER)
    doc = {"tiers": [medium.entry]}
    config = tmp_path / "bare.yaml"
    config.write_text(json.dumps(doc))
    code = main(["verify", "--config", str(config), "--tier", "t", "--delete-unauthenticated"])
    err = capsys.readouterr().err
    assert code == 2 and "--delete-unauthenticated: only with --repair" in err
    assert len(err.strip().splitlines()) == 1
    code, report, _ = verify(
        medium, tmp_path, OWNER, capsys, monkeypatch, "--delete-unauthenticated"
    )
    assert code == 0 and report["repaired"] == BLOCKS and report["left"] == []
    assert medium.found(OTHER) == 0


def test_repair_in_the_owners_own_names_deletes_the_forgeries(
    medium: Medium,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In the store namespace of the owner's secret, where a stranger who listed the store
    wrote 3 objects without a MAC beside the owner's 20: a repair with another secret
    deletes nothing (the names are not its secret's); the owner's repair deletes the 3
    forgeries without being told to, and every block the owner wrote stays."""
    own = store_namespace(NS, OWNER)
    medium.write(OWNER, own)
    medium.write(None, own, range(BLOCKS, BLOCKS + 3))
    code, report, _ = verify(medium, tmp_path, OTHER, capsys, monkeypatch)
    assert report["repaired"] == 0 and len(report["left"]) == BLOCKS + 3
    code, report, table = verify(medium, tmp_path, OWNER, capsys, monkeypatch)
    assert report["checked"] == BLOCKS + 3 and report["ok"] == BLOCKS
    assert report["repaired"] == 3 and report["left"] == []
    assert {reason for _, reason in report["bad"]} == {"auth"}
    assert code == 0 and "0 deleted, 0 left" in table
    assert medium.found(OWNER, own) == BLOCKS
