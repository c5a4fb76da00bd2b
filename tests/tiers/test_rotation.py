"""A fleet rotating its secret (`auth.previous`, `kvtier rekey`), on one real redis-server and
one `files` directory: three engines' tiers switch in turn, first taking the new secret as a
previous one, then writing under it, then dropping the old one after a rekey. No block is lost
at any step, and an engine told to drop a secret serves nothing sealed under it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.cli import main
from kvtier.servers import RedisServer
from tests.tiers import memory_hooks
from tiering.config import parse_config
from tiering.keys import store_namespace
from tiering.manager import build_tiers
from tiering.testing import NAMESPACE, key, payload
from tiering.tier import Tier
from tiering.tier.rotation import RotatingTier
from tiering.tier.values import KeyLike, as_key
from tiers.memory import MemoryTier

pytestmark = pytest.mark.redis

OLD = "the secret being rotated out, 32b"
NEW = "the secret rotated in, 32 bytes.."
ENV = {"KVTIER_OLD": OLD, "KVTIER_NEW": NEW}
SIZE = 4096


def _config(tmp: Path, url: str, secret: str, previous: tuple[str, ...] = ()) -> dict[str, Any]:
    auth: dict[str, Any] = {"secret": "${" + secret + "}", "encrypt": True}
    if previous:
        auth["previous"] = ["${" + p + "}" for p in previous]
    return {
        "auth": auth,
        "tiers": [
            {"name": "f", "type": "file", "layout": "files", "path": str(tmp / "f"), "min_free": 0},
            {"name": "r", "type": "redis", "url": url},
        ],
    }


class Engine:
    """One engine's secondary tiers, rebuilt under each configuration it is given, on one
    event loop (the test's, as an engine's runtime is one)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.tiers: list[Tier] = []
        self.run = loop.run_until_complete

    def configure(self, data: dict[str, Any]) -> None:
        self.close()
        self.tiers = [tier for _, tier in build_tiers(parse_config(data, ENV), NAMESPACE)]

    def close(self) -> None:
        for tier in self.tiers:
            self.run(tier.close())
        self.tiers = []

    def write(self, blocks: range) -> None:
        async def go() -> None:
            for tier in self.tiers:
                for i in blocks:
                    await tier.put(key(i), payload(SIZE, i))

        self.run(go())

    def found(self, blocks: range) -> list[list[int]]:
        """Per tier, the blocks it returns, each checked byte for byte."""

        async def go() -> list[list[int]]:
            out = []
            for tier in self.tiers:
                hits = []
                for i in blocks:
                    got = await tier.get_bytes(key(i), SIZE)
                    if got is not None:
                        assert got == payload(SIZE, i), (tier.name, i)
                        hits.append(i)
                out.append(hits)
            return out

        return self.run(go())


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture
def fleet(loop: asyncio.AbstractEventLoop) -> Iterator[list[Engine]]:
    engines = [Engine(loop) for _ in range(3)]
    yield engines
    for engine in engines:
        engine.close()


def test_a_fleet_rotating_its_secret_in_turn_loses_no_block(
    tmp_path: Path,
    redis_server: RedisServer,
    fleet: list[Engine],
    loop: asyncio.AbstractEventLoop,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = redis_server.url
    for engine in fleet:
        engine.configure(_config(tmp_path, url, "KVTIER_OLD"))
    written = 0
    for engine in fleet:
        engine.write(range(written, written + 3))
        written += 3
    steps = [
        ("KVTIER_OLD", ("KVTIER_NEW",)),  # 1: every engine reads what the new secret writes
        ("KVTIER_NEW", ("KVTIER_OLD",)),  # 2: every engine writes under the new secret
    ]
    for secret, previous in steps:
        for engine in fleet:
            engine.configure(_config(tmp_path, url, secret, previous))
            engine.write(range(written, written + 2))
            written += 2
            for other in fleet:
                assert other.found(range(written)) == [list(range(written))] * 2, (
                    secret,
                    previous,
                )
    # 3: rekey both tiers: the old secret's names empty out, nothing is lost
    config_file = tmp_path / "kvtier.yaml"
    config_file.write_text(yaml.safe_dump(_config(tmp_path, url, "KVTIER_NEW", ("KVTIER_OLD",))))
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    for tier in ("f", "r"):
        assert main(["rekey", "--config", str(config_file), "--tier", tier]) == 0
        assert main(["rekey", "--config", str(config_file), "--tier", tier, "--json"]) == 0
    old_names = store_namespace(NAMESPACE, OLD.encode())
    old_config = parse_config(_config(tmp_path, url, "KVTIER_OLD"), ENV)
    for cfg, tier in build_tiers(old_config, NAMESPACE):
        assert tier.namespace == old_names
        assert loop.run_until_complete(_count(tier)) == 0, f"{cfg.name}: old names hold blocks"
        loop.run_until_complete(tier.close())
    # 4: every engine drops the old secret, in turn: it still finds every block
    for engine in fleet:
        engine.configure(_config(tmp_path, url, "KVTIER_NEW"))
        for other in fleet:
            assert other.found(range(written)) == [list(range(written))] * 2


def test_an_engine_that_dropped_a_secret_serves_nothing_sealed_under_it(
    tmp_path: Path,
    redis_server: RedisServer,
    fleet: list[Engine],
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Blocks written under the old secret (in its names, and planted into the new secret's
    names sealed under the old one) are misses to an engine holding only the new secret, and
    stay where they are; one still holding the old one in `previous` reads its own names."""
    url = redis_server.url
    old, new, after = fleet
    old.configure(_config(tmp_path, url, "KVTIER_OLD"))
    old.write(range(100, 104))
    new.configure(_config(tmp_path, url, "KVTIER_NEW"))
    assert new.found(range(100, 104)) == [[], []]
    planter_config = parse_config(_config(tmp_path, url, "KVTIER_OLD"), ENV)
    new_names = store_namespace(NAMESPACE, NEW.encode())
    for cfg, tier in build_tiers(planter_config, NAMESPACE):
        planter = type(tier)(namespace=new_names, secret=OLD.encode(), options=cfg.record)
        loop.run_until_complete(_plant(planter, range(104, 106)))
        loop.run_until_complete(tier.close())
    assert new.found(range(100, 106)) == [[], []]
    assert all(t.counters["corrupt.auth"] == 2 for t in new.tiers), [
        dict(t.counters) for t in new.tiers
    ]
    after.configure(_config(tmp_path, url, "KVTIER_NEW", ("KVTIER_OLD",)))
    assert after.found(range(100, 104)) == [list(range(100, 104))] * 2
    assert all(t.counters["hits_previous_secret"] == 4 for t in after.tiers)


async def _plant(tier: Tier, blocks: range) -> None:
    async with tier:
        for i in blocks:
            await tier.put(key(i), payload(SIZE, i))


async def _count(tier: Tier) -> int:
    return sum([1 async for _ in tier.keys()])


def test_rekey_resumes_from_its_journal_and_keeps_old_copies_when_told(
    tmp_path: Path,
    redis_server: RedisServer,
    fleet: list[Engine],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--keep` copies and leaves the old names as they were; a second run with `--resume`
    finds every block in its journal and copies none again; without `--keep` the old copies
    go once the new ones read back."""
    import json

    url = redis_server.url
    old = fleet[0]
    old.configure(_config(tmp_path, url, "KVTIER_OLD"))
    old.write(range(200, 206))
    old.close()
    config_file = tmp_path / "kvtier.yaml"
    config_file.write_text(yaml.safe_dump(_config(tmp_path, url, "KVTIER_NEW", ("KVTIER_OLD",))))
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)

    def rekey(*flags: str) -> dict[str, Any]:
        capsys.readouterr()
        assert main(["rekey", "--config", str(config_file), "--tier", "f", "--json", *flags]) == 0
        (moved,) = json.loads(capsys.readouterr().out)["namespaces"]
        return dict(moved)

    first = rekey("--keep")
    assert (first["copied"], first["moved"], first["skipped"]) == (6, 0, 0), first
    again = rekey("--keep", "--resume")
    assert (again["copied"], again["skipped"]) == (0, 6), again
    old.configure(_config(tmp_path, url, "KVTIER_OLD"))
    assert old.found(range(200, 206))[0] == list(range(200, 206))  # kept
    old.close()
    last = rekey()
    assert last["moved"] == 6, last
    old.configure(_config(tmp_path, url, "KVTIER_OLD"))
    assert old.found(range(200, 206))[0] == []
    new = fleet[1]
    new.configure(_config(tmp_path, url, "KVTIER_NEW"))
    assert new.found(range(200, 206))[0] == list(range(200, 206))


def test_a_restart_during_a_rotation_follows_the_manifest_written_under_the_old_secret(
    tmp_path: Path, redis_server: RedisServer, fleet: list[Engine], loop: asyncio.AbstractEventLoop
) -> None:
    """An engine that restarts with the new secret (the old one in `previous`) finds the
    manifest of use its previous run wrote under the old secret's names, and the blocks it
    names through them."""
    from tiering.manager.manifest import Manifest, encode, read_manifest, record_name

    url = redis_server.url
    old, new = fleet[0], fleet[1]
    old.configure(_config(tmp_path, url, "KVTIER_OLD"))
    old.write(range(300, 303))
    for tier in old.tiers:
        manifest = Manifest(tier.namespace, "e1", [key(i) for i in (302, 300)], ended=True)
        loop.run_until_complete(tier.write_record(record_name("e1"), encode(manifest)))
    old.close()
    new.configure(_config(tmp_path, url, "KVTIER_NEW", ("KVTIER_OLD",)))
    stored = store_namespace(NAMESPACE, NEW.encode())
    found, why = loop.run_until_complete(read_manifest(new.tiers, stored, "e1"))
    assert found is not None and list(found.keys) == [key(302), key(300)], why
    assert new.found(range(300, 303)) == [[300, 301, 302]] * 2


class _CountingTier(MemoryTier):
    """A previous secret's names that count what they are asked."""

    asked: list[list[bytes]]

    async def contains(self, keys: Sequence[KeyLike]) -> list[bool]:
        self.asked.append([bytes(as_key(k)) for k in keys])
        return await super().contains(keys)


def test_contains_asks_the_previous_names_once_and_never_for_a_refused_block() -> None:
    """A block refused moments ago in the current names is not asked anywhere, and each
    missing block is asked in the previous names once (not again after the base's
    refused-key filtering)."""

    async def go() -> None:
        current = MemoryTier(namespace=NAMESPACE, secret=b"the new secret, 32 bytes long..")
        old = _CountingTier(namespace=NAMESPACE, secret=b"the old secret, 32 bytes long..")
        old.asked = []
        async with RotatingTier(current, [old]) as tier:
            await old.put(key(2), payload(64, 2))
            foreign = b"".join(bytes(p) for p in old.envelope.seal(key(1), payload(64, 1)))
            memory_hooks.plant(current, key(1), foreign)  # another secret's: refused, kept
            assert not await tier.get(key(1), bytearray(64))
            assert tier.counters["corrupt.auth"] == 1
            old.asked.clear()
            assert await tier.contains([key(1), key(2), key(3)]) == [False, True, False]
            assert old.asked == [[bytes(key(2)), bytes(key(3))]]

    asyncio.run(go())
