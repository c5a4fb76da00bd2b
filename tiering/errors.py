"""The kvtier error tree.

Every error kvtier raises on purpose derives from `KvtierError` and mixes in the builtin that
fits, so callers can catch either (`except ValueError` still works for a bad config). Library
errors are translated at the edge where they happen, with `raise ... from e`.

    KvtierError
    ├── ConfigError (ValueError)            a config file, a name or an argument is wrong
    │   └── UnknownNameError (LookupError)  a policy or tier name that is not registered
    ├── MissingDependencyError (ImportError) an optional package is not installed
    ├── KeyFormatError (ValueError)         a block key or its encoding is malformed
    ├── TraceError (ValueError)             a request trace has a malformed line
    ├── StateError (RuntimeError)           a caller broke a stateful contract
    ├── RegionError (OSError)               the shared primary region cannot be made or mapped
    └── TierError                           a secondary tier failed (the manager counts a miss)
        ├── TierUnavailable (ConnectionError)
        │   └── TlsError (ConfigError)      TLS to the tier's server failed: CA, certificate
        ├── TierTimeout (TimeoutError)
        ├── TierFull (OSError)
        └── CorruptObject (ValueError)      a stored object failed verification; `reason` says why

`assert` stays reserved for kvtier's own invariants; anything a user, a YAML file or a calling
engine can get wrong raises one of these with a message that names what is wrong and where.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "CorruptObject",
    "KeyFormatError",
    "KvtierError",
    "MissingDependencyError",
    "RegionError",
    "StateError",
    "TierError",
    "TierFull",
    "TierTimeout",
    "TierUnavailable",
    "TlsError",
    "TraceError",
    "UnknownNameError",
]


class KvtierError(Exception):
    """Root of every error kvtier raises on purpose."""


class ConfigError(KvtierError, ValueError):
    """A configuration value, a name or a command-line argument is invalid.

    The message starts with the dotted path of the offending field where there is one
    (`tiers[1].capacity: expected a size like '20GiB', got 'lots'`).
    """


class UnknownNameError(ConfigError, LookupError):
    """A name (eviction policy, tier type) that no registry knows; the message lists the known."""


class MissingDependencyError(KvtierError, ImportError):
    """An optional dependency is missing; the message says what to install."""


class KeyFormatError(KvtierError, ValueError):
    """A block key, or its hex or path encoding, is malformed."""


class TraceError(KvtierError, ValueError):
    """A request trace cannot be read; the message names the file and the line."""


class StateError(KvtierError, RuntimeError):
    """A caller broke a stateful contract: completing twice, an unknown key, a wrong state.

    Raised before anything changes, so the object stays consistent.
    """


class RegionError(KvtierError, OSError):
    """The shared primary region cannot be created, found or mapped (space, name, layout)."""


class TierError(KvtierError):
    """A secondary tier failed. The manager turns these into misses and metrics."""


class TierUnavailable(TierError, ConnectionError):
    """The tier's server or device cannot be reached."""


class TlsError(ConfigError, TierUnavailable):
    """TLS to a tier's server failed: a CA that did not sign its certificate, an expired
    certificate, a plaintext server where TLS was asked. A configuration's fault (the CLI
    exits 2 with it) that the manager also takes as an unreachable tier: never a fall back to
    plaintext."""


class TierTimeout(TierError, TimeoutError):
    """A tier operation passed its deadline."""


class TierFull(TierError, OSError):
    """The tier has no room left (a full disk, a memory limit)."""


class CorruptObject(TierError, ValueError):
    """A stored object failed verification (checksum, namespace, format version, length...).

    `reason` is one word, one of `tiering.tier.format.REASONS`: tiers count refused objects under
    `corrupt.<reason>`. The message is `"<reason>: <detail>"`.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.seen: bytes | None = None
        """The refused object's first bytes as read (`tiering.tier.envelope.SEEN_BYTES`: its
        header, MAC and writer tag), when the envelope refused it: a removal takes the object
        only while the store still holds these bytes (`Tier._delete_refused`)."""
