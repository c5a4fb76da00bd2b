"""The manager's counters come from one table (`tiering.manager.counters`): its documentation
is up to date, each name is spelled there only, and "hits" means one thing."""

from __future__ import annotations

import ast
from pathlib import Path

from tiering.manager.counters import (
    COUNTERS,
    MANAGER_COUNTERS,
    MANAGER_METRICS,
    TIER_COUNTERS,
    markdown,
    metric,
)

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "tiering" / "manager" / "counters.py"
PRODUCT = ("tiering", "tiers", "connectors", "kvtier", "bench")


def test_the_documentation_is_the_table() -> None:
    written = (ROOT / "docs" / "COUNTERS.md").read_text()
    assert written == markdown(), (
        "docs/COUNTERS.md is out of date: write it with "
        "python -c \"from tiering.manager.counters import markdown; print(markdown(), end='')\""
        " > docs/COUNTERS.md"
    )


def test_each_counter_once_with_a_one_line_meaning() -> None:
    keys = [(c.scope, c.name) for c in COUNTERS]
    assert len(keys) == len(set(keys))
    for c in COUNTERS:
        assert c.meaning.endswith(".") and "\n" not in c.meaning, c
    assert set(TIER_COUNTERS) | set(MANAGER_COUNTERS) == {c.name for c in COUNTERS}
    assert all(m.startswith("vllm:kvtier_") for m in MANAGER_METRICS.values())
    assert metric("found") == "vllm:kvtier_tier_found"


def test_hits_are_reads_only() -> None:
    """The manager's existence checks count what they found; "hits" is the tier's word for a
    verified read, and no manager counter uses it."""
    assert not any(c.name in ("hits", "misses") for c in COUNTERS)


def test_no_counter_name_is_spelled_outside_the_table() -> None:
    """No product module indexes a `counters` mapping with a literal name of the table (a
    tier's own counters, `Tier.counters`, have their own constants)."""
    names = {c.name for c in COUNTERS}
    found = []
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == TABLE or "testing" in path.parts:  # (the suite reads a tier's own)
                continue
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Subscript)
                    and isinstance(node.slice, ast.Constant)
                    and node.slice.value in names
                    and ast.unparse(node.value).endswith("counters")
                ):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "\n".join(found)
