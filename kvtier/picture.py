"""Line charts for operators' commands (`kvtier plan`): hit rate against capacity, one curve
per policy or tier size, as SVG (no dependency) or PNG (matplotlib, the `plan` extra). Any
thread: plain computation and one file written."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Final

from tiering.errors import ConfigError

__all__ = ["FORMATS", "Chart", "Series", "svg", "write_chart"]

FORMATS: Final = (".svg", ".png")
_COLOURS: Final = (
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
)
_W, _H = 720, 440
_LEFT, _RIGHT, _TOP, _BOTTOM = 70, 200, 40, 60


@dataclass(frozen=True, slots=True)
class Series:
    """One curve: its label and its points (x, y), x increasing."""

    label: str
    points: tuple[tuple[float, float], ...]


@dataclass(frozen=True, slots=True)
class Chart:
    title: str
    x_label: str
    y_label: str
    series: tuple[Series, ...]


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values spanning [low, high]."""
    if high <= low:
        high = low + 1
    raw = (high - low) / count
    step = 10 ** math.floor(math.log10(raw))
    for mult in (1, 2, 5, 10):
        if raw <= mult * step:
            step *= mult
            break
    first = math.floor(low / step) * step
    return [
        first + i * step
        for i in range(int((high - first) / step) + 2)
        if first + i * step <= high + step / 2
    ]


def _label(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:g}M"
    if value >= 1e4:
        return f"{value / 1e3:g}k"
    return f"{value:g}"


def svg(chart: Chart) -> str:
    """The chart as a standalone SVG document."""
    xs = [x for s in chart.series for x, _ in s.points] or [0.0, 1.0]
    ys = [y for s in chart.series for _, y in s.points] or [0.0, 1.0]
    x_ticks = _ticks(min(xs), max(xs))
    y_ticks = _ticks(0.0, max(max(ys), 1e-9))
    x0, x1, y1 = x_ticks[0], x_ticks[-1], y_ticks[-1]
    plot_w, plot_h = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM

    def px(x: float) -> float:
        return _LEFT + (x - x0) / ((x1 - x0) or 1) * plot_w

    def py(y: float) -> float:
        return _TOP + plot_h - y / (y1 or 1) * plot_h

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" '
        f'viewBox="0 0 {_W} {_H}" font-family="sans-serif" font-size="12">',
        f'<rect width="{_W}" height="{_H}" fill="white"/>',
        f'<text x="{_W / 2:.0f}" y="22" text-anchor="middle" font-size="15">'
        f"{escape(chart.title)}</text>",
    ]
    for t in y_ticks:
        out.append(
            f'<line x1="{_LEFT}" x2="{_LEFT + plot_w}" y1="{py(t):.1f}" y2="{py(t):.1f}" '
            'stroke="#ddd"/>'
            f'<text x="{_LEFT - 6}" y="{py(t) + 4:.1f}" text-anchor="end">{_label(t)}</text>'
        )
    for t in x_ticks:
        out.append(
            f'<line x1="{px(t):.1f}" x2="{px(t):.1f}" y1="{_TOP}" y2="{_TOP + plot_h}" '
            'stroke="#eee"/>'
            f'<text x="{px(t):.1f}" y="{_TOP + plot_h + 18}" text-anchor="middle">'
            f"{_label(t)}</text>"
        )
    out.append(
        f'<rect x="{_LEFT}" y="{_TOP}" width="{plot_w}" height="{plot_h}" fill="none" '
        'stroke="#444"/>'
        f'<text x="{_LEFT + plot_w / 2:.0f}" y="{_H - 15}" text-anchor="middle">'
        f"{escape(chart.x_label)}</text>"
        f'<text transform="translate(18 {_TOP + plot_h / 2:.0f}) rotate(-90)" '
        f'text-anchor="middle">{escape(chart.y_label)}</text>'
    )
    for i, series in enumerate(chart.series):
        colour = _COLOURS[i % len(_COLOURS)]
        points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in series.points)
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{points}"/>')
        for x, y in series.points:
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{colour}"/>')
        ly = _TOP + 10 + 18 * i
        out.append(
            f'<line x1="{_W - _RIGHT + 15}" x2="{_W - _RIGHT + 35}" y1="{ly}" y2="{ly}" '
            f'stroke="{colour}" stroke-width="2"/>'
            f'<text x="{_W - _RIGHT + 40}" y="{ly + 4}">{escape(series.label)}</text>'
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _png(chart: Chart, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError as e:
        raise ConfigError(
            f"{path}: a PNG needs matplotlib (pip install 'kvtier[plan]'); or write an .svg"
        ) from e
    figure, axes = pyplot.subplots(figsize=(8, 4.8), dpi=100)
    for series in chart.series:
        xs, ys = zip(*series.points, strict=True) if series.points else ((), ())
        axes.plot(xs, ys, marker="o", label=series.label)
    axes.set_title(chart.title)
    axes.set_xlabel(chart.x_label)
    axes.set_ylabel(chart.y_label)
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)
    axes.legend(loc="best", fontsize="small")
    figure.tight_layout()
    figure.savefig(path)
    pyplot.close(figure)


def write_chart(chart: Chart, path: Path) -> None:
    """Write `chart` to `path`, SVG or PNG by its suffix (`ConfigError` for another)."""
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise ConfigError(f"{path}: a picture is {' or '.join(FORMATS)}, not {suffix or 'none'}")
    if suffix == ".png":
        _png(chart, path)
    else:
        path.write_text(svg(chart))


def series_of(label: str, points: Sequence[tuple[float, float]]) -> Series:
    return Series(label, tuple(sorted(points)))
