"""A Prometheus endpoint for kvtier's own metrics (`metrics.prometheus_port`).

vLLM's stats path carries the same figures to vLLM's `/metrics`; this endpoint is for
deployments that scrape kvtier apart, or run it outside vLLM. The connector starts it
(`connectors.resources`); the manager publishes a snapshot at the end of every step (`publish`);
the HTTP thread only ever reads the latest snapshot.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["MetricsServer", "render"]


def render(snapshot: Mapping[str, Any]) -> str:
    """The Prometheus text format of a manager's `snapshot()` (counters, tier figures and the
    primary's gauges)."""
    lines = []
    for name, value in sorted(snapshot.get("primary", {}).items()):
        lines += [f"# TYPE kvtier_primary_{name} gauge", f"kvtier_primary_{name} {float(value)}"]
    for name, value in sorted(snapshot.get("manager", {}).items()):
        lines += [f"# TYPE kvtier_{name}_total counter", f"kvtier_{name}_total {float(value)}"]
    series: dict[str, list[str]] = {}
    for tier, figures in sorted(snapshot.get("tiers", {}).items()):
        for name, value in sorted(figures.items()):
            if name == "breaker":
                series.setdefault("kvtier_tier_breaker_open", []).append(
                    f'kvtier_tier_breaker_open{{tier="{tier}"}} {float(value != "closed")}'
                )
            elif isinstance(value, int | float) and not isinstance(value, bool):
                metric = "kvtier_tier_" + name.replace(".", "_")
                series.setdefault(metric, []).append(f'{metric}{{tier="{tier}"}} {float(value)}')
    for metric, samples in series.items():
        lines.append(f"# TYPE {metric} gauge")
        lines += samples
    return "\n".join(lines) + "\n"


class MetricsServer:
    """Serves `/metrics`. Scheduler process: its own HTTP thread reads the latest snapshot;
    `publish` is called under the manager's step lock (by the manager's `publish` hook), `close`
    by the connector at shutdown."""

    def __init__(self, port: int, address: str = "127.0.0.1") -> None:
        self._snapshot: Mapping[str, Any] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server name
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                body = render(server._snapshot).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                return

        self.http = ThreadingHTTPServer((address, port), Handler)
        self.port = self.http.server_address[1]
        self._thread = threading.Thread(
            target=self.http.serve_forever, name="kvtier-metrics", daemon=True
        )
        self._thread.start()

    def publish(self, snapshot: Mapping[str, Any]) -> None:
        self._snapshot = snapshot  # one reference swap: readers see the old or the new

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
