"""The manager's counters, in one table (any thread: constants).

Each counter is a constant here, its name spelled nowhere else, with a one-line meaning and
the vLLM metric it is exported as, if any. The table feeds the manager's snapshot (the zeros a
dashboard tells from missing: `tiering.manager.stats`), the vLLM metrics
(`connectors.vllm.manager`: definitions and reports), the scenario's result keys and the
documentation: docs/COUNTERS.md is this table written out (`markdown`; a test keeps it up to
date).

Two scopes: a **tier** counter is kept per secondary tier (`TierState.counters`) and exported
as `vllm:kvtier_tier_<name>{tier=...}`; a **manager** counter is the engine's. One word, one
meaning: a **hit** is a verified read of a block from a tier (the tier's own `hits`,
`tiering.tier.counters`); the manager's existence checks count what they `found` and did not
(`not_found`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

__all__ = [
    "COUNTERS",
    "MANAGER_COUNTERS",
    "MANAGER_METRICS",
    "TIER_COUNTERS",
    "Count",
    "markdown",
    "metric",
]


@dataclass(frozen=True, slots=True)
class Count:
    """One counter: its name, scope, meaning, and the vLLM metric it is exported as."""

    name: str
    scope: Literal["tier", "manager"]
    meaning: str
    metric: str | None = None
    """The vLLM counter (without `_total`); None: in snapshots and replays only. A tier
    counter's is always `vllm:kvtier_tier_<name>`."""


COUNTERS: list[Count] = []


def _count(
    name: str, scope: Literal["tier", "manager"], meaning: str, metric: str | None = None
) -> str:
    if scope == "tier":
        metric = f"vllm:kvtier_tier_{name}"
    COUNTERS.append(Count(name, scope, meaning, metric))
    return name


# -- per tier ----------------------------------------------------------------------------------
LOOKUPS: Final = _count("lookups", "tier", "Blocks looked for in the tier (existence checks).")
FOUND: Final = _count("found", "tier", "Blocks the tier had when looked for.")
NOT_FOUND: Final = _count("not_found", "tier", "Blocks the tier did not have when looked for.")
PROMOTIONS: Final = _count(
    "promotions", "tier", "Blocks promoted from the tier into the CPU primary."
)
PROMOTION_FAILURES: Final = _count(
    "promotion_failures",
    "tier",
    "Promotions that failed (error, timeout, corrupt or missing block).",
)
DEMOTIONS: Final = _count("demotions", "tier", "Blocks written to the tier.")
DEMOTION_FAILURES: Final = _count("demotion_failures", "tier", "Blocks the tier failed to write.")
DEMOTIONS_DROPPED: Final = _count(
    "demotions_dropped", "tier", "Demotions dropped because the tier had too many in flight."
)
DEMOTIONS_SKIPPED: Final = _count(
    "demotions_skipped", "tier", "Demotions not written: the tier already held the block."
)
GATED: Final = _count(
    "gated",
    "tier",
    "Blocks the tier had, not loaded because loading was estimated slower than recomputing.",
)
ERRORS: Final = _count("errors", "tier", "Tier jobs that failed (the breaker counts these).")
BYTES_PROMOTED: Final = _count("bytes_promoted", "tier", "Bytes promoted from the tier.")
BYTES_DEMOTED: Final = _count("bytes_demoted", "tier", "Bytes of the blocks written to the tier.")
PROMOTION_SECONDS: Final = _count(
    "promotion_seconds",
    "tier",
    "Seconds the tier's promotion jobs took, from their start to their result (with"
    " bytes_promoted: the promotion throughput).",
)
HITS_OTHER_WRITER: Final = _count(
    "hits_other_writer",
    "tier",
    "Blocks loaded from the tier that another engine (or an earlier run) stored (the objects'"
    " writer tag; not authenticated).",
)
USAGE_FAILURES: Final = _count(
    "usage_failures",
    "tier",
    "Usage listings of the tier's store that failed or passed their deadline (its last figures"
    " stay).",
)

# -- the manager's ---------------------------------------------------------------------------
DROPPED_DIRECT_EVICTION: Final = _count(
    "demotions_dropped_direct_eviction",
    "manager",
    "Blocks evicted on the store path before a write-back tier had them.",
    "vllm:kvtier_dropped_direct_evictions",
)
DIRECT_EVICTIONS: Final = _count(
    "direct_evictions",
    "manager",
    "Blocks evicted from the CPU primary on the store path (their slots taken by new blocks).",
)
PROMOTIONS_LATE: Final = _count(
    "promotions_late",
    "manager",
    "Promotions that outlived promotion.deadline (blocks recomputed).",
    "vllm:kvtier_promotions_late",
)
PROMOTION_ALLOCATION_FAILURES: Final = _count(
    "promotion_allocation_failures",
    "manager",
    "Blocks of queued promotions that got no CPU primary slot (not promoted).",
)
IDLE_WAITS: Final = _count(
    "idle_waits",
    "manager",
    "Empty engine steps that waited for a promotion or existence check to end instead of spinning.",
    "vllm:kvtier_idle_waits",
)
BLOCKS_WARMED: Final = _count(
    "blocks_warmed",
    "manager",
    "Blocks read into the CPU primary at start (primary.warm_start).",
    "vllm:kvtier_blocks_warmed",
)
WARM_BATCHES: Final = _count(
    "warm_batches", "manager", "Batches of blocks the warm start submitted."
)
WARM_RETRIES: Final = _count(
    "warm_retries", "manager", "Blocks the warm start planned again after their read failed."
)
WARM_PLANNED: Final = _count(
    "warm_planned",
    "manager",
    "Blocks the warm start planned to read (its manifest's keys up to the budget, or the"
    " tiers' newest).",
    "vllm:kvtier_warm_planned",
)
WARM_SKIPPED: Final = _count(
    "warm_skipped",
    "manager",
    "Blocks of the warm start's manifest that no tier held any more: skipped, not read.",
    "vllm:kvtier_warm_skipped",
)
WARM_REMAINING: Final = _count(
    "warm_remaining",
    "manager",
    "Blocks the warm start has still to read (a gauge: 0 once it ended).",
)
WARM_SOURCE: Final = _count(
    "warm_source",
    "manager",
    "What the warm start followed (a gauge): 0 nothing, 1 a manifest, 2 the tiers' newest.",
)
MANIFESTS_WRITTEN: Final = _count(
    "manifests_written",
    "manager",
    "Manifests of use written to a tier (primary.warm_manifest_interval, and at shutdown).",
    "vllm:kvtier_manifests_written",
)
MANIFEST_CLASHES: Final = _count(
    "manifest_clashes",
    "manager",
    "Times another live engine was found writing this engine's identity (primary.engine_id).",
    "vllm:kvtier_manifest_clashes",
)
MANIFEST_REQUESTS: Final = _count(
    "manifest_requests",
    "manager",
    "Requests to write the manifest now (kvtier manifest --write-now) answered with a write.",
    "vllm:kvtier_manifest_requests",
)
MANIFEST_REQUESTS_REFUSED: Final = _count(
    "manifest_requests_refused",
    "manager",
    "Manifest requests refused and removed: not sealed by this deployment's secret, damaged.",
    "vllm:kvtier_manifest_requests_refused",
)
WARM_STOPPED: Final = _count(
    "warm_stopped",
    "manager",
    "Warm starts ended early because a batch failed as a whole.",
    "vllm:kvtier_warm_stopped",
)
STORES_FAILED: Final = _count(
    "stores_failed",
    "manager",
    "Blocks whose store from the engine failed (vLLM 0.34+ reports it): dropped from the CPU"
    " primary, never served.",
    "vllm:kvtier_stores_failed",
)
STORE_COMPLETIONS_IGNORED: Final = _count(
    "store_completions_ignored",
    "manager",
    "Blocks the engine said it stored that the CPU primary was not writing for it (after a"
    " cache reset, or completed twice): ignored.",
    "vllm:kvtier_store_completions_ignored",
)
STORES_REFUSED_TOO_LARGE: Final = _count(
    "stores_refused_too_large",
    "manager",
    "Stores refused because the request needs more CPU primary slots at once than there are"
    " (never offloaded: raise primary.capacity).",
)
STORES_REFUSED_NO_ROOM: Final = _count(
    "stores_refused_no_room",
    "manager",
    "Stores refused because too few CPU primary slots were free or evictable (offered again"
    " next step).",
)
STORE_BLOCKS_REFUSED: Final = _count(
    "store_blocks_refused",
    "manager",
    "Blocks not yet in the CPU primary that refused stores carried.",
)
RESET_SLOTS_QUARANTINED: Final = _count(
    "reset_slots_quarantined",
    "manager",
    "CPU primary slots kept out of use at a cache reset because a job that did not end may"
    " still touch them.",
)
RESET_SLOTS_FENCED: Final = _count(
    "reset_slots_fenced",
    "manager",
    "CPU primary slots kept out of use at a cache reset while the engine's own copies may"
    " still touch them.",
)
BOOKKEEPING_SECONDS: Final = _count(
    "bookkeeping_seconds",
    "manager",
    "Seconds of wall time the runtime thread's bookkeeping passes took (applying results,"
    " submitting jobs).",
)
BOOKKEEPING_CPU_SECONDS: Final = _count(
    "bookkeeping_cpu_seconds",
    "manager",
    "Seconds of CPU time of those passes.",
)
BOOKKEEPING_ON_SCHEDULER: Final = _count(
    "bookkeeping_on_scheduler",
    "manager",
    "Engine steps whose end ran the between-step work on the scheduler's thread (the"
    " runtime had not got to it).",
)
CLOSE_ERRORS: Final = _count(
    "close_errors",
    "manager",
    "Shutdowns whose flush could not run: the runtime was shut down already.",
)
TRACE_WRITTEN: Final = _count(
    "trace_written",
    "manager",
    "Requests written to the recorded trace (trace.record).",
    "vllm:kvtier_trace_written",
)
TRACE_DROPPED: Final = _count(
    "trace_dropped",
    "manager",
    "Requests not recorded: the trace writer's queue was full, or vLLM's adapter tracked too many "
    "requests at once (the oldest is dropped).",
    "vllm:kvtier_trace_dropped",
)
TRACE_FAILED: Final = _count(
    "trace_failed",
    "manager",
    "Requests not recorded: writing the trace file failed (read-only, removed, full disk).",
    "vllm:kvtier_trace_failed",
)

TIER_COUNTERS: Final = {c.name: c.meaning for c in COUNTERS if c.scope == "tier"}
"""The counters every tier has in a snapshot, at zero until they move: name -> meaning."""
MANAGER_COUNTERS: Final = {c.name: c.meaning for c in COUNTERS if c.scope == "manager"}
"""The manager's counters: name -> meaning."""
MANAGER_METRICS: Final = {
    c.name: c.metric for c in COUNTERS if c.scope == "manager" and c.metric is not None
}
"""The manager's counters exported as vLLM metrics: name -> metric."""


def metric(name: str) -> str:
    """The vLLM metric counter `name` is exported as (`KeyError` for one that is not)."""
    found = next((c.metric for c in COUNTERS if c.name == name and c.metric), None)
    if found is None:
        raise KeyError(f"counter {name!r} is not exported as a vLLM metric")
    return found


def markdown() -> str:
    """docs/COUNTERS.md: the table written out."""
    lines = [
        "# kvtier's counters",
        "",
        "Written out from the table in `tiering/manager/counters.py` (its `markdown()`);"
        " `tests/tiering/test_counters_table.py` keeps it up to date. A tier's own counters"
        " (`hits`: verified reads, `corrupt.<reason>`, ...) are named in the tier's counters"
        " module; a snapshot shows them as `tier.<name>`. vLLM counters end in `_total` on"
        " /metrics.",
        "",
        "| counter | scope | vLLM metric | meaning |",
        "|---|---|---|---|",
    ]
    for c in COUNTERS:
        label = "{tier=...}" if c.scope == "tier" else ""
        metric = "" if c.metric is None else f"`{c.metric}{label}`"
        lines.append(f"| `{c.name}` | {c.scope} | {metric} | {c.meaning} |")
    return "\n".join(lines) + "\n"
