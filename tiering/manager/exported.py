"""The vLLM metrics kvtier exports, as data (any thread: constants).

One list, `EXPORTED`, of every metric the vLLM connector defines and reports
(`connectors.vllm.manager`: its definitions are built from this list): the counters of the
counters' table that are exported (`tiering.manager.counters`), the warm start's gauges, the
tiers' usage gauges (`tiering.manager.usage`), the CPU primary's occupancy, the breakers and the
tier jobs' latency histogram. The Grafana dashboard (`kvtier.dashboard`) is generated from the
same list, and its test holds every panel's query to a name in `series()`: what vLLM's
`/metrics` really shows (a counter's name with `_total`, a histogram's `_bucket`, `_sum`,
`_count`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from tiering.manager.counters import (
    MANAGER_COUNTERS,
    MANAGER_METRICS,
    TIER_COUNTERS,
    WARM_REMAINING,
    WARM_SOURCE,
)
from tiering.manager.usage import USAGE_GAUGES

__all__ = [
    "BREAKER",
    "EXPORTED",
    "LATENCY",
    "LATENCY_BUCKETS",
    "READING",
    "USED",
    "WARM_GAUGES",
    "WRITING",
    "Exported",
    "by_name",
    "series",
]

USED: Final = "vllm:kvtier_primary_used_perc"
WRITING: Final = "vllm:kvtier_primary_write_perc"
READING: Final = "vllm:kvtier_primary_read_perc"
BREAKER: Final = "vllm:kvtier_tier_breaker_open"
LATENCY: Final = "vllm:kvtier_tier_job_seconds"
LATENCY_BUCKETS: Final = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)
WARM_GAUGES: Final = {
    WARM_REMAINING: "vllm:kvtier_warm_remaining",
    WARM_SOURCE: "vllm:kvtier_warm_source",
}
"""The warm start's gauges: counter name -> metric (their documentation: MANAGER_COUNTERS)."""


@dataclass(frozen=True, slots=True)
class Exported:
    """One vLLM metric kvtier exports: its name (without vLLM's `_total`), kind, help text and
    label names (vLLM adds its own, such as `model_name` and `engine`)."""

    name: str
    kind: Literal["counter", "gauge", "histogram"]
    documentation: str
    labels: tuple[str, ...] = ()


def _build() -> list[Exported]:
    tier = ("tier",)
    metrics = [
        Exported(
            USED, "gauge", "Fraction of kvtier's CPU primary slots holding a block (any state)."
        ),
        Exported(WRITING, "gauge", "Fraction of kvtier's CPU primary slots being written."),
        Exported(
            READING,
            "gauge",
            "Fraction of kvtier's CPU primary slots pinned by loads and demotions.",
        ),
        Exported(BREAKER, "gauge", "1 while a tier's circuit breaker is open or half-open.", tier),
        Exported(
            LATENCY,
            "histogram",
            "Duration of kvtier's tier jobs (checks, promotions, demotions).",
            tier,
        ),
    ]
    metrics += [Exported(m, "counter", MANAGER_COUNTERS[n]) for n, m in MANAGER_METRICS.items()]
    metrics += [Exported(m, "gauge", MANAGER_COUNTERS[n]) for n, m in WARM_GAUGES.items()]
    metrics += [
        Exported(f"vllm:kvtier_tier_{n}", "counter", doc, tier) for n, doc in TIER_COUNTERS.items()
    ]
    metrics += [  # (set once the tier's usage has been polled)
        Exported(f"vllm:kvtier_tier_{n}", "gauge", doc, tier) for n, doc in USAGE_GAUGES.items()
    ]
    return metrics


EXPORTED: Final = _build()


def by_name() -> dict[str, Exported]:
    return {m.name: m for m in EXPORTED}


def series() -> dict[str, Exported]:
    """The names `/metrics` shows -> their metric: a counter's with `_total`, a histogram's
    `_bucket` (with the `le` label), `_sum` and `_count`, a gauge's as it is."""
    names: dict[str, Exported] = {}
    for m in EXPORTED:
        if m.kind == "counter":
            names[m.name + "_total"] = m
        elif m.kind == "histogram":
            for suffix in ("_bucket", "_sum", "_count"):
                names[m.name + suffix] = m
        else:
            names[m.name] = m
    return names
