"""What the TLS tests of the Redis and S3 tiers share: a wrong TLS set-up refused at open."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tiering.errors import ConfigError, TierUnavailable, TlsError


def refused_at_open(make: Any, tier: str, seconds: float = 3.0) -> str:
    """The one-line message of the `TlsError` `make()` raises at open, within `seconds`: a
    `ConfigError` (the operator's to fix) and a `TierUnavailable` (the tier is down), naming
    tier `tier`."""
    start = time.monotonic()
    with pytest.raises(TlsError) as caught:
        make()
    assert time.monotonic() - start < seconds
    message = str(caught.value)
    assert "\n" not in message and f"tier {tier!r}" in message
    assert isinstance(caught.value, ConfigError) and isinstance(caught.value, TierUnavailable)
    return message
