"""A running engine asked to write its manifest of use now (`kvtier manifest --write-now`,
`tiering.manager.request`), on a files directory and a real redis-server; a request not sealed
by the deployment's secret refused; a flood of requests bounded by the floor; two engines of one
identity told at start; every engine's manifest in `kvtier stats`."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier.cli import main
from tests.helpers.manager import Harness
from tests.helpers.manifests import THROUGH, file_tier, wait_for, warm
from tiering.config import TierConfig
from tiering.keys import store_namespace
from tiering.manager.counters import (
    MANIFEST_CLASHES,
    MANIFEST_REQUESTS,
    MANIFEST_REQUESTS_REFUSED,
)
from tiering.manager.recorder import ManifestRecorder
from tiering.manager.request import ManifestRequest, encode_request, request_name
from tiering.testing import NAMESPACE
from tiering.tier import Tier

SECRET = b"s" * 32


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recorder writes on request at most every 0.3 s (it looks every 50 ms: `engine`)."""
    monkeypatch.setattr("tiering.manager.recorder.FLOOR", 0.3)


class Store:
    """Where an engine and the command meet: a tier of `namespace` (a fresh object each call)
    and the command's YAML for it."""

    def __init__(
        self, tier: Callable[[], Tier], yaml: str, config: Path, namespace: bytes = NAMESPACE
    ) -> None:
        self.tier, self.config, self.namespace = tier, config, namespace
        config.write_text(f"primary: {{engine_id: gpu-0}}\ntiers: [{yaml}]\n")

    def record(self, name: str) -> bytes | None:
        async def read() -> bytes | None:
            async with self.tier() as tier:
                return await tier.read_record(name)

        return asyncio.run(read())


def files_store(tmp_path: Path) -> Store:
    path = tmp_path / "store"
    yaml = f"{{name: nvme, type: file, path: {path}, min_free: 0}}"
    return Store(lambda: file_tier(path), yaml, tmp_path / "kvtier.yaml")


@pytest.fixture(params=["files", pytest.param("redis", marks=pytest.mark.redis)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "files":
        return files_store(tmp_path)
    from tiers.redis import RedisTier

    url = request.getfixturevalue("redis_server").url
    namespace = time.monotonic_ns().to_bytes(16, "big")  # its own on the shared server

    def redis() -> Tier:
        return RedisTier(namespace=namespace, name="nvme", url=url)

    return Store(
        redis, f"{{name: nvme, type: redis, url: '{url}'}}", tmp_path / "kvtier.yaml", namespace
    )


def engine(
    make: Callable[..., Harness], tier: Tier, blocks: range = range(3), **extra: Any
) -> Harness:
    """An engine of identity gpu-0 (a manifest every minute, a look for requests every 50 ms)
    over `tier`, holding `blocks`, its start's manifest written."""
    primary = {"engine_id": "gpu-0", "warm_manifest_interval": 60.0, "manifest_requests": 0.05}
    primary |= extra
    cfg = TierConfig(name=tier.name, type=tier.type_name, write="through")
    h = make([(cfg, tier)], slots=16, primary=warm(2, **primary))
    wait_for(h, lambda: recorder(h).written >= 1)
    for i in blocks:
        h.store(i)
        h.settle()
    return h


def recorder(h: Harness) -> ManifestRecorder:
    found = h.manager.recorder
    assert found is not None
    return found


def ask(store: Store, *extra: str) -> int:
    return main(
        ["manifest", "--config", str(store.config), "--tier", "nvme"]
        + ["--namespace", store.namespace.hex(), "--write-now", *extra]
    )


def test_write_now_makes_the_running_engine_write_its_manifest(
    make: Callable[..., Harness],
    store: Store,
    quick: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The command's request is found, answered with a manifest of the blocks the engine holds
    now (not the start's), and removed; the command shows that manifest."""
    h = engine(make, store.tier())
    before = recorder(h).written
    assert ask(store, "--wait", "10", "--json", "--keys", "3") == 0
    out = capsys.readouterr()
    shown = json.loads(out.out)
    assert shown["engine"] == "gpu-0" and shown["blocks"] == 3 and not shown["ended"]
    assert shown["answered_seconds"] < 10
    assert "asked engine gpu-0" in out.err
    assert h.manager.counters[MANIFEST_REQUESTS] == 1
    assert recorder(h).written == before + 1
    assert store.record(request_name("gpu-0")) is None


def test_write_now_without_a_running_engine_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nobody answers: exit 1, one line naming the identity, the request taken back."""
    store = files_store(tmp_path)
    began = time.monotonic()
    assert ask(store, "--wait", "1") == 1
    assert time.monotonic() - began < 5
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "kvtier manifest: no running engine with identity gpu-0 answered within 1 s (asked "
        "through tier 'nvme'; an engine with primary.manifest_requests: 0 never looks)"
    )
    assert len(err) == 2  # the status line, then the answer
    assert store.record(request_name("gpu-0")) is None


def test_a_request_not_sealed_by_the_secret_is_refused_and_a_sealed_one_answered(
    make: Callable[..., Harness], tmp_path: Path, quick: None
) -> None:
    """Under `auth.secret`, a request planted in the engine's names without the seal is
    removed unanswered and counted; one sealed with the secret is answered."""
    mine = store_namespace(NAMESPACE, SECRET)
    h = engine(make, file_tier(tmp_path, secret=SECRET, namespace=mine))
    before = recorder(h).written

    async def plant(secret: bytes | None) -> None:
        async with file_tier(tmp_path, secret=secret, namespace=mine) as tier:
            await tier.write_record(request_name("gpu-0"), encode_request(ManifestRequest("gpu-0")))

    asyncio.run(plant(None))
    wait_for(h, lambda: h.manager.counters[MANIFEST_REQUESTS_REFUSED] == 1)
    assert not (tmp_path / ".kvtier" / "records" / f"{mine.hex()}.manifest-request.gpu-0").exists()
    time.sleep(0.5)
    assert h.manager.counters[MANIFEST_REQUESTS] == 0 and recorder(h).written == before
    asyncio.run(plant(SECRET))
    wait_for(h, lambda: h.manager.counters[MANIFEST_REQUESTS] == 1)
    assert recorder(h).written == before + 1


def test_a_flood_of_requests_writes_no_more_often_than_the_floor(
    make: Callable[..., Harness], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request every 10 ms for 2 s, looked for every 20 ms, a floor of 0.8 s: 2 or 3
    writes, not 100."""
    monkeypatch.setattr("tiering.manager.recorder.FLOOR", 0.8)
    h = engine(make, file_tier(tmp_path), manifest_requests=0.02)
    before = recorder(h).written

    async def flood() -> None:
        async with file_tier(tmp_path) as tier:
            end = time.monotonic() + 2.0
            while time.monotonic() < end:
                await tier.write_record(
                    request_name("gpu-0"), encode_request(ManifestRequest("gpu-0"))
                )
                await asyncio.sleep(0.01)

    asyncio.run(flood())
    written = recorder(h).written - before
    assert 1 <= written <= 3, written
    assert h.manager.counters[MANIFEST_REQUESTS] == written


def test_an_engine_that_never_looks_for_requests_reads_none(
    make: Callable[..., Harness], tmp_path: Path, quick: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`primary.manifest_requests: 0`: the recorder never opens the request record (no GET on
    an S3 that bills each one), the command is not answered and takes its request back, and
    the periodic write still runs."""
    monkeypatch.setattr("tiering.manager.recorder.POLL", 0.05)  # a default would answer
    store = files_store(tmp_path)
    tier = store.tier()
    reads: list[str] = []
    read_record = tier.read_record

    async def counted(name: str, *args: Any, **kw: Any) -> bytes | None:
        reads.append(name)
        return await read_record(name, *args, **kw)

    tier.read_record = counted  # type: ignore[method-assign]
    h = engine(make, tier, manifest_requests=0, warm_manifest_interval=0.2)
    before = recorder(h).written
    assert ask(store, "--wait", "1") == 1
    assert h.manager.counters[MANIFEST_REQUESTS] == 0
    assert "manifest.gpu-0" in reads  # the recorder reads through this tier (its clash check)
    assert request_name("gpu-0") not in reads
    assert recorder(h).written > before


def test_two_engines_of_one_identity_are_told_at_start_not_at_the_first_interval(
    make: Callable[..., Harness], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The first engine finds no manifest (a fresh store) and writes one at start; a second of
    the same identity started a moment later, with a minute's interval, is told at once: one
    warning naming the identity and the other writer, counted."""
    primary = warm(2, engine_id="gpu-0", warm_manifest_interval=60.0)
    one = make([(THROUGH, file_tier(tmp_path))], slots=16, primary=primary)
    wait_for(one, lambda: recorder(one).written >= 1)
    with caplog.at_level(logging.WARNING, "tiering.manager.recorder"):
        two = make([(THROUGH, file_tier(tmp_path))], slots=16, primary=primary)
        wait_for(two, lambda: two.manager.counters[MANIFEST_CLASHES] == 1, timeout=5.0)
    said = [r.getMessage() for r in caplog.records if "engine identity gpu-0" in r.getMessage()]
    assert len(said) == 1
    assert f"pid {recorder(one).manifest([]).pid}" in said[0] and "host" in said[0]


def test_stats_shows_every_engines_manifest(
    make: Callable[..., Harness], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two engines (gpu-0 stopped, gpu-1 running) on one directory: both manifests, per tier
    and namespace, with their age, size, whether ended and their warm start."""
    store = tmp_path / "store"
    first = engine(make, file_tier(store))
    first.close()
    second = engine(make, file_tier(store), range(10, 13), engine_id="gpu-1")
    config = tmp_path / "kvtier.yaml"
    config.write_text(
        f"primary: {{engine_id: gpu-0}}\ntiers: [{{name: nvme, type: file, path: {store}, "
        "min_free: 0}]\n"
    )
    assert main(["stats", "--config", str(config), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    shown = {m["engine"]: m for m in row["manifests"]}
    assert set(shown) == {"gpu-0", "gpu-1"} and not row["manifests_more"]
    assert shown["gpu-0"]["ended"] and shown["gpu-0"]["blocks"] == 3
    assert not shown["gpu-1"]["ended"] and shown["gpu-1"]["age_seconds"] < 60
    assert shown["gpu-1"]["warm_source"] in ("manifest", "newest", "none")
    assert main(["stats", "--config", str(config)]) == 0
    text = capsys.readouterr().out
    assert "manifests of use:" in text
    lines = [line for line in text.splitlines() if " gpu-" in line]
    assert len(lines) == 2 and " yes " in lines[0] and " no " in lines[1]
    second.close()
