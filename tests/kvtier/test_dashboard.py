"""The Grafana dashboard (configs/grafana-kvtier.json) is what `python -m kvtier.dashboard`
writes, and every panel's query reads metrics the vLLM connector really exports, by labels they
carry; the panels an operator asks for are there."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvtier.dashboard import PATH, dashboard, main, render
from tests.helpers.paths import ROOT
from tiering.manager.exported import series

_TOKEN = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\{([^}]*)\}")
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_VLLM_LABELS = {"model_name", "engine"}


def _exprs() -> list[tuple[str, str]]:
    model = json.loads(PATH.read_text())
    return [(p["title"], t["expr"]) for p in model["panels"] for t in p["targets"]]


def test_the_committed_dashboard_is_the_generated_one(tmp_path: Path) -> None:
    assert PATH == ROOT / "configs" / "grafana-kvtier.json"
    assert PATH.read_text() == render(), (
        "configs/grafana-kvtier.json is out of date: python -m kvtier.dashboard"
    )
    main([str(tmp_path / "d.json")])
    assert json.loads((tmp_path / "d.json").read_text()) == dashboard()


def test_every_query_reads_exported_metrics_by_their_labels() -> None:
    exported = series()
    for title, expr in _exprs():
        selectors = _SELECTOR.findall(expr)
        assert selectors, (title, expr)
        metrics = {name for name, _ in selectors}
        # every name with a colon (vLLM's prefix) is a metric: none hides outside a selector
        assert {t for t in _TOKEN.findall(expr) if ":" in t} == metrics, (title, expr)
        labels: set[str] = set()
        for name in metrics:
            assert name in exported, f"{title}: {name} is not on /metrics"
            metric = exported[name]
            labels |= set(metric.labels) | _VLLM_LABELS
            if name.endswith("_bucket") and metric.kind == "histogram":
                labels.add("le")
        for _, matchers in selectors:
            for matcher in filter(None, matchers.split(",")):
                assert re.split(r"[=!~]", matcher.strip())[0] in labels, (title, matcher)
        for grouping in _GROUPING.findall(expr):
            for label in filter(None, (s.strip() for s in grouping.split(","))):
                assert label in labels, (title, label)


def test_a_query_of_a_metric_not_exported_is_caught() -> None:
    """The check above would see a wrong name: the counter without vLLM's `_total`."""
    assert "vllm:kvtier_tier_found" not in series()
    assert "vllm:kvtier_tier_found_total" in series()


def test_the_panels_an_operator_asks_for() -> None:
    queried = " ".join(expr for _, expr in _exprs())
    for name in (
        "vllm:kvtier_tier_found_total",  # hits and misses per tier
        "vllm:kvtier_tier_not_found_total",
        "vllm:kvtier_tier_bytes_promoted_total",  # bytes out of and into the tier
        "vllm:kvtier_tier_bytes_demoted_total",
        "vllm:kvtier_tier_usage_objects",  # objects and bytes against capacity
        "vllm:kvtier_tier_usage_bytes",
        "vllm:kvtier_tier_capacity_bytes",
        "vllm:kvtier_tier_breaker_open",
        "vllm:kvtier_promotions_late_total",
        "vllm:kvtier_blocks_warmed_total",  # the warm start
        "vllm:kvtier_warm_remaining",
    ):
        assert name in queried, name
    titles = [p["title"] for p in dashboard()["panels"]]
    assert len(titles) == len(set(titles))
