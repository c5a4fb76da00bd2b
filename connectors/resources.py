"""`Resources`: what one role of an engine holds open for kvtier, opened through it and closed by
it, once.

Every role maps the primary region and joins the engine's roster; the scheduler also holds the
background runtime, the secondary tiers, kvtier's metrics server and the manager over them; a
worker, its copy engine. The spec opens them through a `Resources` and hands it to the adapter
it returns (`connectors.vllm.manager.KvtierManager`, `connectors.vllm.worker.KvtierWorker`),
whose `shutdown` is `close`; a spec that fails half-way closes what it had opened.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from connectors.roles import Roster
from tiering.metrics import MetricsServer
from tiering.runtime import Runtime
from tiers.region import PrimaryRegion, RegionLayout

if TYPE_CHECKING:
    from tiering.config import Config, TierConfig
    from tiering.manager import TieringOffloadingManager
    from tiering.tier import Tier
    from tiers.copy import CopyEngine

__all__ = ["Resources"]

TIER_CLOSE_TIMEOUT = 5.0
"""Seconds each tier is given to close."""


class Resources:
    """What one role holds open. Scheduler or worker process: opened and closed on the thread
    vLLM builds and shuts down its connector on."""

    def __init__(self) -> None:
        self.region: PrimaryRegion | None = None
        self.roster: Roster | None = None
        self.runtime: Runtime | None = None
        self.tiers: list[tuple[TierConfig, Tier]] = []
        self.metrics_server: MetricsServer | None = None
        self.manager: TieringOffloadingManager | None = None
        """Set by the spec once built over `runtime` and `tiers`: its shutdown flushes into
        the tiers, which are closed here after it, then the runtime."""
        self.engine: CopyEngine | None = None
        """A worker's copy engine, set by the spec once built over `region`."""
        self._closed = False

    def open_region(
        self, engine_id: str, layout: RegionLayout, config: Config, role: str
    ) -> PrimaryRegion:
        """This role's mapping of the primary region, proved to be the one every other role
        of the engine maps, under the same config (`connectors.roles`): otherwise a
        `RegionError` stops the engine before anything reaches a tier."""
        self.region = PrimaryRegion.open(engine_id, layout, config.primary.directory)
        roster = Roster(engine_id)
        roster.join(role, self.region, config)
        self.roster = roster
        return self.region

    def open_tiers(
        self, config: Config, namespace: bytes
    ) -> tuple[Runtime, list[tuple[TierConfig, Tier]]]:
        """The runtime and the configured secondary tiers in `namespace`."""
        from tiering.manager import build_tiers

        runtime = self.runtime = Runtime(config.faults.breaker)
        self.tiers = build_tiers(config, namespace)
        return runtime, self.tiers

    def open_metrics_server(self, config: Config) -> MetricsServer | None:
        """kvtier's Prometheus endpoint, with `metrics.prometheus_port` (the manager opens no
        socket: the connector does)."""
        metrics = config.metrics
        if metrics.prometheus_port is not None:
            self.metrics_server = MetricsServer(metrics.prometheus_port, metrics.address)
        return self.metrics_server

    def close(self) -> None:
        """Close what was opened, once, in this order, each step taken whatever the one before
        raised (the first error is raised at the end): the metrics server; the manager (its
        shutdown flushes into the tiers and stops its work); the tiers; the runtime (stopping
        its thread); the copy engine (joining its threads); the region; the roster."""
        if self._closed:
            return
        self._closed = True
        steps: list[Callable[[], None]] = []
        if self.metrics_server is not None:
            steps.append(self.metrics_server.close)
        if self.manager is not None:
            steps.append(self.manager.shutdown)
        if self.tiers:
            steps.append(self._close_tiers)
        if self.runtime is not None:
            steps.append(self.runtime.shutdown)
        if self.engine is not None:
            steps.append(self.engine.shutdown)
        if self.region is not None:
            steps.append(self.region.close)
        if self.roster is not None:
            steps.append(self.roster.leave)
        error: BaseException | None = None
        for step in steps:
            try:
                step()
            except BaseException as e:  # the rest must still close
                error = error or e
        if error is not None:
            raise error

    def _close_tiers(self) -> None:
        from tiering.manager import close_tiers

        assert self.runtime is not None  # opened with the tiers
        close_tiers(self.runtime, self.tiers, TIER_CLOSE_TIMEOUT)
