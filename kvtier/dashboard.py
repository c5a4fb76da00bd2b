"""kvtier's Grafana dashboard, generated from the metrics the vLLM connector exports.

`python -m kvtier.dashboard [PATH]` writes it (default `configs/grafana-kvtier.json`); a test
holds the committed file equal to what this writes and every panel's query to a name vLLM's
`/metrics` really shows (`tiering.manager.exported.series`). Each panel names its metrics
through `exported.by_name()`, so a metric renamed or dropped there fails here, at generation.
The dashboard reads a Prometheus data source (the `datasource` variable) scraping vLLM's
`/metrics`; `model_name` filters one model's engines.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tiering.manager.exported import BREAKER, LATENCY, READING, USED, WRITING, by_name

__all__ = ["PATH", "dashboard", "main", "panels", "render"]

PATH = Path(__file__).resolve().parents[1] / "configs" / "grafana-kvtier.json"
_SOURCE = {"type": "prometheus", "uid": "${datasource}"}
_FILTER = 'model_name=~"$model_name"'


def _name(metric: str) -> str:
    """`metric` as `/metrics` shows it; KeyError for one kvtier does not export."""
    kind = by_name()[metric].kind
    return metric + "_total" if kind == "counter" else metric


def _tier(metric: str) -> str:
    return f"vllm:kvtier_tier_{metric}"


def _rate(metric: str) -> str:
    return f"sum by (tier) (rate({_name(metric)}{{{_FILTER}}}[$__rate_interval]))"


def _gauge(metric: str, by: str = "tier", over: str = "max") -> str:
    """`metric`'s value now, over the engines (`over`: max for one store's figures every engine
    reports, sum for each engine's own)."""
    grouping = f" by ({by})" if by else ""
    return f"{over}{grouping} ({_name(metric)}{{{_FILTER}}})"


def _panel(title: str, unit: str, description: str, *targets: tuple[str, str]) -> dict[str, Any]:
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": _SOURCE,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"datasource": _SOURCE, "expr": expr, "legendFormat": legend, "refId": chr(65 + i)}
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def panels() -> list[dict[str, Any]]:
    """The panels, in reading order: what each tier gives, what it holds, whether it is healthy,
    then the CPU primary and the warm start."""
    latency = _name(LATENCY) + "_bucket"
    return [
        _panel(
            "Lookups found and missed per second, per tier",
            "ops",
            "Blocks a tier had (found) and did not have (missed) when looked for.",
            (_rate(_tier("found")), "{{tier}} found"),
            (_rate(_tier("not_found")), "{{tier}} missed"),
        ),
        _panel(
            "Blocks promoted and demoted per second, per tier",
            "ops",
            "Blocks read from a tier into the CPU primary (promoted) and written to it (demoted).",
            (_rate(_tier("promotions")), "{{tier}} promoted"),
            (_rate(_tier("demotions")), "{{tier}} demoted"),
        ),
        _panel(
            "Bytes per second out of and into each tier",
            "Bps",
            "Bytes promoted from a tier (out) and demoted to it (in).",
            (_rate(_tier("bytes_promoted")), "{{tier}} out"),
            (_rate(_tier("bytes_demoted")), "{{tier}} in"),
        ),
        _panel(
            "Bytes used against capacity, per tier",
            "bytes",
            "The tier's whole store (every engine's), this engine's namespace, and the capacity"
            " (absent when unbounded).",
            (_gauge(_tier("usage_bytes")), "{{tier}} used"),
            (_gauge(_tier("usage_own_bytes")), "{{tier}} this namespace"),
            (_gauge(_tier("capacity_bytes")), "{{tier}} capacity"),
        ),
        _panel(
            "Objects per tier",
            "short",
            "Objects in the tier's whole store and in this engine's namespace.",
            (_gauge(_tier("usage_objects")), "{{tier}} objects"),
            (_gauge(_tier("usage_own_objects")), "{{tier}} this namespace"),
        ),
        _panel(
            "Breaker open, per tier",
            "short",
            "1 while a tier's circuit breaker is open or half-open: the tier is cut off.",
            (_gauge(BREAKER), "{{tier}}"),
        ),
        _panel(
            "Errors and failures per second, per tier",
            "ops",
            "Tier jobs that failed (the breaker counts these), failed promotions and demotions.",
            (_rate(_tier("errors")), "{{tier}} errors"),
            (_rate(_tier("promotion_failures")), "{{tier}} promotion failures"),
            (_rate(_tier("demotion_failures")), "{{tier}} demotion failures"),
        ),
        _panel(
            "Tier job latency (p50, p99)",
            "s",
            "Duration of tier jobs: checks, promotions, demotions.",
            (
                f"histogram_quantile(0.5, sum by (tier, le) (rate({latency}{{{_FILTER}}}"
                "[$__rate_interval])))",
                "{{tier}} p50",
            ),
            (
                f"histogram_quantile(0.99, sum by (tier, le) (rate({latency}{{{_FILTER}}}"
                "[$__rate_interval])))",
                "{{tier}} p99",
            ),
        ),
        _panel(
            "Late promotions per second",
            "ops",
            "Promotions that outlived promotion.deadline: their blocks were recomputed.",
            (
                f"sum (rate({_name('vllm:kvtier_promotions_late')}{{{_FILTER}}}"
                "[$__rate_interval]))",
                "late",
            ),
        ),
        _panel(
            "CPU primary slots",
            "percentunit",
            "Fraction of the CPU primary's slots holding a block, being written, being read.",
            (_gauge(USED, by=""), "used"),
            (_gauge(WRITING, by=""), "writing"),
            (_gauge(READING, by=""), "reading"),
        ),
        _panel(
            "Warm start",
            "short",
            "Blocks the warm start planned, read, skipped (no tier held them) and has still to"
            " read.",
            (_gauge("vllm:kvtier_warm_planned", by="", over="sum"), "planned"),
            (_gauge("vllm:kvtier_blocks_warmed", by="", over="sum"), "warmed"),
            (_gauge("vllm:kvtier_warm_skipped", by="", over="sum"), "skipped"),
            (_gauge("vllm:kvtier_warm_remaining", by="", over="sum"), "remaining"),
        ),
    ]


def dashboard() -> dict[str, Any]:
    """The dashboard's JSON model, two panels a row."""
    laid = [
        {"id": i + 1, "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)}} | panel
        for i, panel in enumerate(panels())
    ]
    return {
        "title": "kvtier",
        "uid": "kvtier",
        "description": "kvtier's tiers under vLLM (generated by python -m kvtier.dashboard).",
        "tags": ["kvtier", "vllm"],
        "timezone": "browser",
        "refresh": "10s",
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus"},
                {
                    "name": "model_name",
                    "type": "query",
                    "datasource": _SOURCE,
                    "query": f"label_values({_name(USED)}, model_name)",
                    "includeAll": True,
                    "allValue": ".*",
                    "multi": True,
                    "current": {"text": "All", "value": "$__all"},
                },
            ]
        },
        "panels": laid,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvtier.dashboard", description=__doc__)
    parser.add_argument("path", nargs="?", type=Path, default=PATH, help=f"default: {PATH}")
    args = parser.parse_args(argv)
    args.path.write_text(render())


if __name__ == "__main__":
    main()
