"""Loading a compiled extension: a missing module or attribute is a warning and None."""

from __future__ import annotations

import pytest

from tiering.compiled import load_extension


def test_a_missing_module_is_a_warning_naming_it_and_none(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert load_extension("tiering._nowhere", "thing", "Python does it") is None
    assert "compiled thing is missing" in caplog.text and "Python does it" in caplog.text
    assert "tiering._nowhere" in caplog.text


def test_a_missing_attribute_is_a_warning_and_none(caplog: pytest.LogCaptureFixture) -> None:
    assert load_extension("tiering.units", "core", "slower", attribute="Nowhere") is None
    assert "compiled core is missing" in caplog.text and "Nowhere" in caplog.text


def test_the_built_extensions_load() -> None:
    """`pip install` built them (a C compiler is present here and in CI)."""
    assert load_extension("tiering._pool", "pool", "-") is not None
    assert load_extension("tiering.policies._arc", "ARC", "-", attribute="ARC") is not None
