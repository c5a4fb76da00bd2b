"""kvtier's application: what operators run, above the three planes.

The `kvtier` command line (`kvtier.cli`), the operations it runs on stored blocks
(`kvtier.operations`: migrate, verify, purge, migration journals), the raw baselines of
`kvtier bench` (`kvtier.baselines`), the trace replay (`kvtier.trace`, `kvtier.replay`), the
demo (`kvtier.demo`) and the virtual environment vLLM runs in (`kvtier.venv`), plus the loopback
server launchers that the tests and bench/ share (`kvtier.servers`).

It may import every plane (`tiering`, `tiers`, `connectors`); nothing imports it (import-linter
checks both, see .importlinter).
"""

from __future__ import annotations

from importlib import metadata

__all__ = ["__version__"]


def _version() -> str:
    try:
        return metadata.version("kvtier")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"


__version__ = _version()
