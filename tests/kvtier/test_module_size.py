"""The shape of the product modules (kvtier/, tiering/, tiers/, connectors/): none over 500
lines, each opening with a docstring whose first line says what it is (not why it is long), no
benchmark figure in any docstring (BENCHMARKS.md holds them), and at most fifteen modules side
by side at tiering/'s root (a family of modules is a package)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

PACKAGES = ("kvtier", "tiering", "tiers", "connectors")
MAX_LINES = 500
MAX_TIERING_ROOT = 15

ABOUT_LENGTH = re.compile(r"\b\d{3,}\s+lines\b|\blines\s+long\b", re.IGNORECASE)
"""A module docstring that explains the module's size ("over 400 lines: ...") instead of
saying what the module is: find the seam and split instead."""

FIGURE = re.compile(
    r"\d ?(µs|us|ns)\b"  # a measured duration below a millisecond
    r"|\d ?[KMGT]i?B/s\b"  # a throughput
    r"|\d(\.\d+)?x (faster|slower|the|as)\b"  # a measured ratio
    r"|\b(took|measured at|runs? at) ~?\d"  # a measurement quoted as such
)
"""What a benchmark's figure looks like in prose. Sizes and durations that are settings or
defaults (`200ms`, `4 KiB`, the 5 ms switch interval) are not figures."""


def product_modules() -> Iterator[Path]:
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob("*.py"))


def relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


def docstrings(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """(line, text) of the module's docstring and of every class's and function's."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            text = ast.get_docstring(node, clean=False)
            if text:
                yield node.body[0].lineno, text


def test_there_are_product_modules_to_check() -> None:
    found = {relative(path).split("/")[0] for path in product_modules()}
    assert found == set(PACKAGES)


def test_tiering_keeps_at_most_fifteen_modules_at_its_root() -> None:
    """docs/DESIGN.md ("tiering/'s root") says which modules stay there and why."""
    root = sorted(path.name for path in (ROOT / "tiering").glob("*.py"))
    assert len(root) <= MAX_TIERING_ROOT, root


def test_no_product_module_is_over_500_lines() -> None:
    long = {
        relative(path): lines
        for path in product_modules()
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines (find the seam and split): {long}"


@pytest.mark.parametrize("path", list(product_modules()), ids=relative)
def test_every_module_says_what_it_is(path: Path) -> None:
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    assert docstring, f"{relative(path)}: no module docstring"
    first = docstring.strip().splitlines()[0].strip()
    assert len(first) >= 20, f"{relative(path)}: first docstring line {first!r} says too little"
    about = ABOUT_LENGTH.search(docstring)
    assert not about, f"{relative(path)}: the docstring explains its length ({about[0]!r})"


def test_no_docstring_quotes_a_benchmark_figure() -> None:
    found = [
        f"{relative(path)}:{line + offset}: {text.strip()}"
        for path in product_modules()
        for line, docstring in docstrings(ast.parse(path.read_text(encoding="utf-8")))
        for offset, text in enumerate(docstring.splitlines())
        if FIGURE.search(text)
    ]
    assert not found, "figures belong in BENCHMARKS.md:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        "64 MiB copied into fresh slots took ~50 ms here",
        "a round trip of ~50 µs against ~110 µs",
        "promotion at 1.03 GiB/s inside the engine",
        "the compiled reader is 1.6x faster than the Python one",
    ],
)
def test_a_figure_is_recognised(line: str) -> None:
    assert FIGURE.search(line)


@pytest.mark.parametrize(
    "line",
    [
        "promotion: {deadline: 200ms, gate: auto}",
        "whole 4 KiB blocks",
        "up to a switch interval (5 ms) each time",
        "Sizes and durations as kvtier reads and writes them: `8GiB`, `512 MB`, `200ms`, `1h`.",
    ],
)
def test_a_setting_is_not_a_figure(line: str) -> None:
    assert not FIGURE.search(line)
