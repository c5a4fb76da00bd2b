"""`tiering.gil`: the switch interval is short while some owner has work the engine waits on,
and what the process had comes back when none has."""

from __future__ import annotations

import os
import sys

import pytest

from tiering import gil

pytestmark = pytest.mark.usefixtures("interval")  # (tests/tiering/conftest.py)


def test_a_claim_shortens_the_interval_and_its_release_restores_it(interval: float) -> None:
    owner = gil.Urgency()
    owner.set(True)
    assert sys.getswitchinterval() == pytest.approx(gil.DEFAULT_INTERVAL)
    assert gil.holders() == 1
    owner.set(True)  # idempotent: still one claim
    assert gil.holders() == 1
    owner.set(False)
    assert sys.getswitchinterval() == pytest.approx(interval)
    assert gil.holders() == 0


def test_the_interval_comes_back_only_when_the_last_owner_lets_go(interval: float) -> None:
    first, second = gil.Urgency(), gil.Urgency()
    first.set(True)
    second.set(True)
    first.set(False)
    assert sys.getswitchinterval() == pytest.approx(gil.DEFAULT_INTERVAL)
    second.set(False)
    assert sys.getswitchinterval() == pytest.approx(interval)


def test_an_interval_someone_else_set_meanwhile_is_kept() -> None:
    owner = gil.Urgency()
    owner.set(True)
    sys.setswitchinterval(0.002)  # another library's choice, while kvtier holds its own
    owner.set(False)
    assert sys.getswitchinterval() == pytest.approx(0.002)


def test_a_shorter_interval_than_kvtiers_is_left_alone() -> None:
    sys.setswitchinterval(0.0001)
    owner = gil.Urgency()
    owner.set(True)
    assert sys.getswitchinterval() == pytest.approx(0.0001)
    owner.set(False)
    assert sys.getswitchinterval() == pytest.approx(0.0001)


def test_zero_leaves_the_interpreters_interval(interval: float) -> None:
    gil.configure(0)
    owner = gil.Urgency()
    owner.set(True)
    assert sys.getswitchinterval() == pytest.approx(interval)
    owner.set(False)
    with pytest.raises(ValueError, match="switch interval -1"):
        gil.configure(-1)


def test_a_forked_child_starts_with_the_interval_from_before_the_claim(interval: float) -> None:
    owner = gil.Urgency()
    owner.set(True)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its interval and holders, then what a stale release does
        try:
            start = sys.getswitchinterval()
            child = gil.Urgency()
            child.set(True)
            owner.set(False)  # a claim from before the fork: not the child's to release
            os.write(write, f"{start} {sys.getswitchinterval()} {gil.holders()}".encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    got = os.read(read, 100).decode().split()
    os.close(read)
    assert float(got[0]) == pytest.approx(interval)
    assert float(got[1]) == pytest.approx(gil.DEFAULT_INTERVAL)  # the child's own claim, kept
    assert int(got[2]) == 1
    owner.set(False)
    assert sys.getswitchinterval() == pytest.approx(interval)
