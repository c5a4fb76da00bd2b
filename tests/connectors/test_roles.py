"""The roles of one engine prove at start that they map the same primary region under the same
config (`connectors.roles`): real region files, real processes for the other roles."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from connectors.roles import SWEEP_AGE, Roster, config_digests
from tests.helpers.namespaces import unshare_pid
from tiering.config import Config, parse_config
from tiering.errors import RegionError
from tiers.region import PrimaryRegion, RegionLayout

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = RegionLayout(4, 4096)


@pytest.fixture
def regions(tmp_path: Path) -> Iterator[list[PrimaryRegion]]:
    made: list[PrimaryRegion] = []
    yield made
    for region in made:
        region.close()


def region(made: list[PrimaryRegion], directory: Path, name: str = "engine") -> PrimaryRegion:
    directory.mkdir(parents=True, exist_ok=True)
    r = PrimaryRegion.open(name, LAYOUT, directory)
    made.append(r)
    return r


def config(directory: Path, **primary: object) -> Config:
    return parse_config({"primary": {"directory": str(directory), **primary}})


def test_roles_of_one_region_and_config_join(tmp_path: Path, regions: list[PrimaryRegion]) -> None:
    shm = tmp_path / "shm"
    worker = region(regions, shm)
    scheduler = region(regions, shm)  # joins the worker's file
    assert scheduler.token == worker.token and not scheduler.owner
    roster = Roster("engine", tmp_path)
    roster.join("worker rank 0", worker, config(shm))
    Roster("engine", tmp_path).join("scheduler", scheduler, config(shm))
    entries = [json.loads(line) for line in roster.path.read_text().splitlines()]
    assert [e["role"] for e in entries] == ["worker rank 0", "scheduler"]


def test_a_role_of_another_region_is_refused_naming_both(
    tmp_path: Path, regions: list[PrimaryRegion]
) -> None:
    """The issue's case: `primary.directory` edited between the worker's start and the
    scheduler's: each would map a region of its own."""
    worker = region(regions, tmp_path / "a")
    Roster("engine", tmp_path).join("worker rank 0", worker, config(tmp_path / "a"))
    scheduler = region(regions, tmp_path / "b")
    assert scheduler.owner  # a second region: nobody else maps it
    with pytest.raises(RegionError) as info:
        Roster("engine", tmp_path).join("scheduler", scheduler, config(tmp_path / "b"))
    message = str(info.value)
    assert "\n" not in message
    assert "worker rank 0 and scheduler map different primary regions" in message
    assert str(worker.path) in message and str(scheduler.path) in message
    assert "primary.directory" in message


def test_a_role_started_with_another_config_is_refused(
    tmp_path: Path, regions: list[PrimaryRegion]
) -> None:
    shm = tmp_path / "shm"
    worker = region(regions, shm)
    Roster("engine", tmp_path).join("worker rank 0", worker, config(shm))
    with pytest.raises(RegionError, match=r"different kvtier configs \(primary.prefault differ"):
        Roster("engine", tmp_path).join(
            "scheduler", region(regions, shm), config(shm, prefault=False)
        )


def test_config_digests_name_every_value_and_hide_them() -> None:
    cfg = parse_config(
        {"tiers": [{"name": "r", "type": "redis", "url": "redis://:hunter2@127.0.0.1:1/0"}]}
    )
    digests = config_digests(cfg)
    assert "tiers[0].options.url" in digests and "primary.directory" in digests
    assert "hunter2" not in json.dumps(digests)
    other = dataclasses.replace(cfg, primary=dataclasses.replace(cfg.primary, eviction="arc"))
    changed = {k for k, v in config_digests(other).items() if digests.get(k) != v}
    assert changed == {"primary.eviction"}


_OTHER_ROLE = """
import sys, time
from pathlib import Path
from connectors.roles import Roster
from tiering.config import parse_config
from tiers.region import PrimaryRegion, RegionLayout
shm, roster_dir, stay = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
engine = sys.argv[4]
shm.mkdir(parents=True, exist_ok=True)
region = PrimaryRegion.open(engine, RegionLayout(4, 4096), shm)
Roster(engine, roster_dir).join(
    "worker rank 0", region, parse_config({"primary": {"directory": str(shm)}})
)
print("joined", flush=True)
time.sleep(stay)
"""


def other_role(
    shm: Path,
    roster_dir: Path,
    stay: float,
    engine: str = "engine",
    prefix: Sequence[str] = (),
) -> subprocess.Popen[str]:
    """A role of `engine` in a process of its own (started with `prefix`: another pid
    namespace), mapping its region in `shm`, for `stay` seconds."""
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-c", _OTHER_ROLE, str(shm), str(roster_dir), str(stay), engine],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "joined"
    return proc


def test_a_live_role_in_another_process_is_checked(
    tmp_path: Path, regions: list[PrimaryRegion]
) -> None:
    worker = other_role(tmp_path / "a", tmp_path, 30)
    try:
        scheduler = region(regions, tmp_path / "b")
        with pytest.raises(RegionError, match="map different primary regions"):
            Roster("engine", tmp_path).join("scheduler", scheduler, config(tmp_path / "b"))
    finally:
        worker.kill()
        worker.communicate()


def test_a_dead_roles_entry_is_dropped(tmp_path: Path, regions: list[PrimaryRegion]) -> None:
    """An engine restarted with the same engine id after a crash: the old roles' entries
    (their processes gone) neither refuse the new ones nor stay in the roster."""
    old = other_role(tmp_path / "old", tmp_path, 0)
    old.communicate(timeout=30)
    roster = Roster("engine", tmp_path)
    roster.join("scheduler", region(regions, tmp_path / "new"), config(tmp_path / "new"))
    entries = [json.loads(line) for line in roster.path.read_text().splitlines()]
    assert [e["pid"] for e in entries] == [os.getpid()]
    roster.leave()
    assert not roster.path.exists()


def test_a_live_role_in_another_pid_namespace_is_checked(
    tmp_path: Path, regions: list[PrimaryRegion]
) -> None:
    """A role started in another pid namespace (its pid, 1 or so, names another process here)
    is alive while it holds its region: the scheduler of another region is refused. Before, its
    entry was dropped as dead and the two started on different regions without a word."""
    worker = other_role(tmp_path / "a", tmp_path, 30, prefix=unshare_pid())
    try:
        scheduler = region(regions, tmp_path / "b")
        with pytest.raises(RegionError, match="map different primary regions"):
            Roster("engine", tmp_path).join("scheduler", scheduler, config(tmp_path / "b"))
    finally:
        worker.kill()
        worker.communicate()


def _aged(path: Path) -> None:
    """`path` last changed `SWEEP_AGE` and more ago."""
    then = time.time() - SWEEP_AGE - 5
    os.utime(path, (then, then))


def test_the_roster_of_an_engine_killed_with_sigkill_is_removed_by_the_next_start(
    tmp_path: Path, regions: list[PrimaryRegion]
) -> None:
    """An engine killed with -9 never leaves its roster, and its engine id never comes back:
    the next role to join any roster removes it. A live engine's roster stays, here one in
    another pid namespace. Before, the dead one stayed in /dev/shm for good."""
    dead = other_role(tmp_path / "dead", tmp_path, 60, engine="killed")
    dead.kill()
    dead.communicate()
    inside = other_role(tmp_path / "in", tmp_path, 30, engine="contained", prefix=unshare_pid())
    try:
        rosters = {name: Roster(name, tmp_path).path for name in ("killed", "contained")}
        for path in rosters.values():
            assert path.exists()
            _aged(path)
        Roster("fresh", tmp_path).join(
            "scheduler", region(regions, tmp_path / "fresh", "fresh"), config(tmp_path / "fresh")
        )
        assert not rosters["killed"].exists()
        assert rosters["contained"].exists()
    finally:
        inside.kill()
        inside.communicate()


def test_a_reused_pid_is_not_taken_for_the_role(
    tmp_path: Path, regions: list[PrimaryRegion]
) -> None:
    roster = Roster("engine", tmp_path)
    stale = {
        "role": "worker rank 0",
        "pid": os.getpid(),  # alive, but another process started it: another start time
        "started": "1",
        "region": "/elsewhere/kvtier-engine.region",
        "token": "00" * 16,
        "config": {},
    }
    roster.path.write_text(json.dumps(stale) + "\n")
    roster.join("scheduler", region(regions, tmp_path / "shm"), config(tmp_path / "shm"))


@pytest.mark.parametrize(
    "planted",
    [b"\x00\xff garbage\n", b'{"role": 1}\n', b"[1, 2]\n" * 1000, b"x" * (2 << 20)],
    ids=["binary", "wrong-types", "not-objects", "huge"],
)
def test_a_planted_roster_costs_nothing(
    tmp_path: Path, regions: list[PrimaryRegion], planted: bytes
) -> None:
    roster = Roster("engine", tmp_path)
    roster.path.write_bytes(planted)
    began = time.monotonic()
    roster.join("scheduler", region(regions, tmp_path / "shm"), config(tmp_path / "shm"))
    assert time.monotonic() - began < 2


def test_a_roster_that_is_a_link_or_a_fifo_is_refused(
    tmp_path: Path, regions: list[PrimaryRegion]
) -> None:
    roster = Roster("engine", tmp_path)
    target = tmp_path / "elsewhere"
    target.write_text("")
    roster.path.symlink_to(target)
    with pytest.raises(RegionError, match="cannot open"):
        roster.join("scheduler", region(regions, tmp_path / "shm"), config(tmp_path / "shm"))
    roster.path.unlink()
    os.mkfifo(roster.path)
    with pytest.raises(RegionError, match="not a regular file"):
        roster.join("scheduler", region(regions, tmp_path / "shm2"), config(tmp_path / "shm2"))
