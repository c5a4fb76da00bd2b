"""The error tree: every kvtier error is a KvtierError and the builtin it resembles."""

from __future__ import annotations

import pytest

from tiering import errors


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        (errors.ConfigError, ValueError),
        (errors.UnknownNameError, LookupError),
        (errors.UnknownNameError, errors.ConfigError),
        (errors.MissingDependencyError, ImportError),
        (errors.KeyFormatError, ValueError),
        (errors.TraceError, ValueError),
        (errors.StateError, RuntimeError),
        (errors.RegionError, OSError),
        (errors.TierUnavailable, ConnectionError),
        (errors.TierTimeout, TimeoutError),
        (errors.TierFull, OSError),
        (errors.CorruptObject, ValueError),
        (errors.CorruptObject, errors.TierError),
    ],
)
def test_hierarchy(error: type[Exception], builtin: type[Exception]) -> None:
    assert issubclass(error, errors.KvtierError) and issubclass(error, builtin)


def test_everything_exported_is_an_error() -> None:
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.KvtierError)
