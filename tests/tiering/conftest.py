"""Fixtures of the control plane's tests: the manager's harnesses, and the interpreter's switch
interval put back."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.helpers.manager import Harness
from tiering import gil
from tiering.config import TierConfig
from tiering.tier import Tier


@pytest.fixture
def make() -> Iterator[Callable[..., Harness]]:
    """Builds harnesses (`make(tiers, **options)`), shut down at the end of the test."""
    made: list[Harness] = []

    def build(tiers: list[tuple[TierConfig, Tier]], **kw: Any) -> Harness:
        made.append(Harness(tiers, **kw))
        return made[-1]

    yield build
    for h in made:
        h.close()


@pytest.fixture
def interval() -> Iterator[float]:
    """The process's own switch interval, put back after the test (and kvtier's default config
    of `tiering.gil`); modules that change it use it for every test (`usefixtures`)."""
    before = sys.getswitchinterval()
    gil.configure(gil.DEFAULT_INTERVAL)
    yield before
    gil.configure(gil.DEFAULT_INTERVAL)
    sys.setswitchinterval(before)
