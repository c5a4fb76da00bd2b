"""`kvtier top`'s data: running engines' kvtier metrics read from their Prometheus endpoints
(vLLM's `/metrics`), turned into rates between two reads, and laid out as lines of text for a
screen of a given width (the caller's thread; a read's fetches on a few threads of their own).

An endpoint is read with a plain HTTP GET whose whole answer must come within a time bound; one
that does not answer in time (however slowly it sends), answers an error or something that is
no metrics text is *down* with a short reason, and is read again at the next refresh (a fetch
still stuck then is not doubled: one thread per endpoint at most). Only kvtier's metrics
(`tiering.manager.exported`) are kept, summed over
the labels vLLM adds (`engine`, `model_name`) per tier. Rates are the counters' increase over
the time between two reads of the same endpoint (a counter that went back, a restarted engine,
counts from zero).
"""

from __future__ import annotations

import math
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from tiering.manager.counters import WARM_REMAINING, WARM_SOURCE
from tiering.manager.exported import BREAKER, USED, WARM_GAUGES

__all__ = ["MAX_BYTES", "Endpoint", "Reading", "TierRow", "fetch", "lines", "parse", "read_all"]

MAX_BYTES: Final = 8 << 20
"""The most bytes of one endpoint's answer read (vLLM's /metrics is tens of KiB)."""
_PREFIX: Final = "vllm:kvtier_"
_LINE: Final = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL: Final = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
_SOURCES: Final = {0: "none", 1: "manifest", 2: "newest"}
_TIER: Final = "vllm:kvtier_tier_"


def parse(text: str) -> dict[tuple[str, str], float]:
    """kvtier's samples in a Prometheus text exposition: (name, tier label or "") -> value,
    summed over other labels. Raises ValueError when `text` holds no metrics line at all."""
    out: dict[tuple[str, str], float] = {}
    seen = False
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            continue
        seen = True
        name, labels, value = match.groups()
        if not name.startswith(_PREFIX):
            continue
        try:
            number = float(value)
        except ValueError:
            continue
        if math.isnan(number):
            continue
        tier = ""
        for key, label in _LABEL.findall(labels or ""):
            if key == "tier":
                tier = label
        out[(name, tier)] = out.get((name, tier), 0.0) + number
    if not seen:
        raise ValueError("no metrics in the answer")
    return out


@dataclass
class Reading:
    """One endpoint's last read: its samples and when, or why it is down."""

    samples: dict[tuple[str, str], float] = field(default_factory=dict)
    at: float = 0.0
    down: str | None = None


def fetch(url: str, timeout: float) -> Reading:
    """One GET of `url`: its kvtier samples, or why it is down. The answer must end within
    `timeout` in all (an endpoint that sends a byte at a time is down, not waited for)."""
    at = time.monotonic()
    deadline = at + timeout
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:  # noqa: S310
            chunks: list[bytes] = []
            size = 0
            while True:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no whole answer within {timeout:g} s")
                chunk = answer.read1(1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
                if size > MAX_BYTES:
                    raise ValueError(f"an answer over {MAX_BYTES >> 20} MiB")
        samples = parse(b"".join(chunks).decode("utf-8", "replace"))
    except urllib.error.HTTPError as e:
        return Reading(down=f"HTTP {e.code}", at=at)
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        return Reading(down=str(reason).splitlines()[0][:60] or type(e).__name__, at=at)
    return Reading(samples, at)


@dataclass
class Endpoint:
    """A running engine's metrics endpoint and its last two reads (what rates come from)."""

    url: str
    now: Reading = field(default_factory=Reading)
    before: Reading | None = None

    def read(self, timeout: float) -> None:
        """GET the endpoint (at most about `timeout` seconds); a failure marks it down."""
        self.update(fetch(self.url, timeout))

    def update(self, reading: Reading) -> None:
        """Take `reading` as the endpoint's latest (the one before it kept for rates)."""
        if reading.down is None:
            if self.now.down is None and self.now.samples:
                self.before = self.now
            elif self.now.down is not None:
                self.before = None  # back after a gap: rates start again
        self.now = reading

    def value(self, name: str, tier: str = "") -> float | None:
        return self.now.samples.get((name, tier))

    def rate(self, name: str, tier: str = "") -> float | None:
        """The counter's increase per second between the last two reads."""
        if self.before is None or self.now.down is not None:
            return None
        now, then = self.now.samples.get((name, tier)), self.before.samples.get((name, tier))
        seconds = self.now.at - self.before.at
        if now is None or seconds <= 0:
            return None
        increase = now - (then or 0.0) if then is not None and now >= then else now
        return increase / seconds

    def tiers(self) -> list[str]:
        return sorted(
            {tier for (name, tier) in self.now.samples if tier and name.startswith(_TIER)}
        )


_reading: dict[str, threading.Thread] = {}
"""The fetch still running for each URL (one at a time: a stuck endpoint holds one thread)."""


def read_all(endpoints: Sequence[Endpoint], timeout: float) -> None:
    """Read every endpoint at once, a thread each, and return within about `timeout`: an
    endpoint whose answer has not ended by then is down for this refresh (its thread is left to
    end on its own, and no second one is started for it meanwhile)."""
    results: dict[str, Reading] = {}
    started: list[tuple[Endpoint, threading.Thread]] = []
    for e in endpoints:
        running = _reading.get(e.url)
        if running is not None and running.is_alive():
            e.update(Reading(down="still reading its last answer", at=time.monotonic()))
            continue

        def work(url: str = e.url) -> None:
            results[url] = fetch(url, timeout)

        thread = threading.Thread(target=work, name="kvtier-top", daemon=True)
        _reading[e.url] = thread
        thread.start()
        started.append((e, thread))
    deadline = time.monotonic() + timeout + 0.5
    for e, thread in started:
        thread.join(max(0.0, deadline - time.monotonic()))
        reading = results.get(e.url)
        if reading is None:
            reading = Reading(down=f"no answer within {timeout:g} s", at=time.monotonic())
        e.update(reading)


@dataclass(frozen=True, slots=True)
class TierRow:
    """One tier of one engine as `top` shows it."""

    tier: str
    hits: float | None
    misses: float | None
    bytes_in: float | None
    """Into the engine: promoted from the tier, per second."""
    bytes_out: float | None
    """Out to the tier: demoted, per second."""
    objects: float | None
    used: float | None
    capacity: float | None
    breaker_open: bool


def tier_rows(endpoint: Endpoint) -> list[TierRow]:
    rows = []
    for tier in endpoint.tiers():

        def rate(counter: str, tier: str = tier) -> float | None:
            return endpoint.rate(f"{_TIER}{counter}_total", tier)

        def gauge(name: str, tier: str = tier) -> float | None:
            return endpoint.value(f"{_TIER}{name}", tier)

        rows.append(
            TierRow(
                tier,
                rate("found"),
                rate("not_found"),
                rate("bytes_promoted"),
                rate("bytes_demoted"),
                gauge("usage_objects"),
                gauge("usage_bytes"),
                gauge("capacity_bytes"),
                bool(endpoint.value(BREAKER, tier)),
            )
        )
    return rows


def _num(value: float | None, unit: str = "") -> str:
    if value is None:
        return "-"
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{suffix}{unit}"
    return f"{value:.0f}{unit}" if value >= 10 or value == 0 else f"{value:.1f}{unit}"


def _used(row: TierRow) -> str:
    if row.used is None:
        return "-"
    if not row.capacity:
        return _num(row.used, "B")
    return f"{_num(row.used, 'B')}/{_num(row.capacity, 'B')} {100 * row.used / row.capacity:.0f}%"


HEADER: Final = ("tier", "hit/s", "miss/s", "in/s", "out/s", "objects", "used/capacity", "breaker")


def lines(endpoints: Sequence[Endpoint], width: int, clock: str) -> list[str]:
    """The screen: per engine a line of its own (its URL, the primary, late promotions, the
    warm start), then its tiers, each row cut to `width`."""
    out = [f"kvtier top  {clock}  {len(endpoints)} engine(s)  (q quits)"[:width]]
    for e in endpoints:
        out.append("")
        if e.now.down is not None:
            out.append(f"{e.url}  DOWN: {e.now.down}; trying again"[:width])
            continue
        used = e.value(USED)
        late = e.value("vllm:kvtier_promotions_late_total")
        late_rate = e.rate("vllm:kvtier_promotions_late_total")
        source = e.value(WARM_GAUGES[WARM_SOURCE])
        remaining = e.value(WARM_GAUGES[WARM_REMAINING])
        warmed = e.value("vllm:kvtier_blocks_warmed_total")
        warm = "-" if source is None else _SOURCES.get(int(source), "?")
        if remaining:
            warm += f", {remaining:.0f} left"
        if warmed is not None:
            warm += f", {warmed:.0f} read"
        summary = (
            f"{e.url}  primary {'-' if used is None else f'{100 * used:.0f}%'}"
            f"  late {'-' if late is None else f'{late:.0f}'} ({_num(late_rate)}/s)"
            f"  warm start {warm}"
        )
        out.append(summary[:width])
        rows = [HEADER] + [
            (
                r.tier,
                _num(r.hits),
                _num(r.misses),
                _num(r.bytes_in, "B"),
                _num(r.bytes_out, "B"),
                _num(r.objects),
                _used(r),
                "OPEN" if r.breaker_open else "closed",
            )
            for r in tier_rows(e)
        ]
        if len(rows) == 1:
            out.append("  (no kvtier tier metrics yet)"[:width])
            continue
        widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
        for row in rows:
            rest = zip(row[1:], widths[1:], strict=True)
            cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in rest]
            out.append(("  " + " ".join(cells))[:width])
    return out
