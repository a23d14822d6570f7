"""The Grafana dashboard (helm/rlfabric/dashboards/rlfabric.json) drawn from a real Prometheus as a PNG, no
Grafana needed: every panel's PromQL is queried over a time range and drawn where the dashboard's grid
puts it (stat panels as their last value, time series as lines, exemplars as diamonds). The README's
screenshot is drawn this way from a test run (tests/deploy/test_prometheus_scrape.py).

    python -m rlfabric.tools.render_dashboard --prometheus http://127.0.0.1:9090 --minutes 15 \\
        --rows Run "Step time" dashboard.png
"""

from __future__ import annotations

import argparse
import json
import re
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "rlfabric" / "dashboards" / "rlfabric.json"
GRID_COLUMNS = 24
POINTS_PER_SERIES = 240  # query_range resolution
# Grafana's dark theme
BACKGROUND, PANEL, TEXT, GRID = "#111217", "#181b1f", "#ccccdc", "#2c3235"
COLORS = ("#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9", "#fade2a", "#96d98d")


@dataclass
class Series:
    labels: dict[str, str]
    times: list[float]  # unix seconds
    values: list[float]


class PrometheusApi:
    """The three reads a dashboard makes: instant and range queries, and exemplars."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")

    def _get(self, path: str, **params) -> list[dict]:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as response:
            body = json.load(response)
        if body["status"] != "success":
            raise RuntimeError(f"{path} {params}: {body.get('error')}")
        return body["data"]["result"] if isinstance(body["data"], dict) else body["data"]

    def instant(self, expr: str, at: float) -> list[Series]:
        return [Series(r["metric"], [float(r["value"][0])], [float(r["value"][1])])
                for r in self._get("query", query=expr, time=at)]

    def range(self, expr: str, start: float, end: float) -> list[Series]:
        step = max((end - start) / POINTS_PER_SERIES, 1.0)
        return [Series(r["metric"], [float(t) for t, _ in r["values"]], [float(v) for _, v in r["values"]])
                for r in self._get("query_range", query=expr, start=start, end=end, step=step)]

    def exemplars(self, expr: str, start: float, end: float) -> list[tuple[float, float, dict[str, str]]]:
        """(time, value, exemplar labels) of the exemplars of the series `expr` reads."""
        return [(float(e["timestamp"]), float(e["value"]), e["labels"])
                for group in self._get("query_exemplars", query=expr, start=start, end=end)
                for e in group["exemplars"]]


def legend(template: str, labels: dict[str, str]) -> str:
    """Grafana's legendFormat: "{{phase}}" -> the series' phase label."""
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template or "").strip()
    return text or ", ".join(f"{k}={v}" for k, v in labels.items() if k != "__name__") or "value"


def sections(dashboard: dict, rows: list[str] | None) -> list[dict]:
    """The panels under the rows named (all when None), moved up over the rows left out."""
    kept, row_title, shift, section_top = [], "", 0, 0
    panels = sorted(dashboard["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))
    for panel in panels:
        if panel["type"] == "row":
            if rows is not None and row_title not in rows:
                shift += panel["gridPos"]["y"] - section_top  # the section just ended is left out
            row_title, section_top = panel["title"], panel["gridPos"]["y"]
        if rows is None or row_title in rows:
            kept.append({**panel, "gridPos": {**panel["gridPos"], "y": panel["gridPos"]["y"] - shift}})
    return kept


def _format(value: float, unit: str) -> str:
    if value != value:  # NaN
        return "NaN"
    text = f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return f"{text} s" if unit == "s" else text


def render_dashboard(prometheus: PrometheusApi, start: float, end: float, path: Path,
                     dashboard: dict | None = None, rows: list[str] | None = None,
                     width_in: float = 20.0) -> dict[str, int]:
    """Draws the dashboard over [start, end] into `path`; returns {panel title: series drawn}."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state, renders with Agg

    dashboard = dashboard or json.loads(DASHBOARD.read_text())
    panels = sections(dashboard, rows)
    if not panels:
        titles = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
        raise ValueError(f"the dashboard has no rows {rows}; its rows: {titles}")
    grid_height = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    unit_in = width_in / GRID_COLUMNS * 0.42  # Grafana: a grid row is 30 px, a column ~1/24 of ~1700 px
    header_in = 0.6
    height_in = grid_height * unit_in + header_in
    figure = Figure(figsize=(width_in, height_in), facecolor=BACKGROUND)
    figure.text(0.01, 1 - header_in / 2 / height_in, f"{dashboard['title']}  —  "
                f"{datetime.fromtimestamp(start):%Y-%m-%d %H:%M:%S} to {datetime.fromtimestamp(end):%H:%M:%S}",
                color=TEXT, fontsize=14, va="center")

    def inches(x: float, y: float, w: float, h: float) -> tuple[float, float, float, float]:
        """A box in inches from the top left -> matplotlib's figure fractions from the bottom left."""
        return x / width_in, 1 - (y + h) / height_in, w / width_in, h / height_in

    drawn: dict[str, int] = {}
    column_in, gap = width_in / GRID_COLUMNS, 0.05
    for panel in panels:
        grid = panel["gridPos"]
        x, y = grid["x"] * column_in + gap, header_in + grid["y"] * unit_in + gap
        w, h = grid["w"] * column_in - 2 * gap, grid["h"] * unit_in - 2 * gap
        if panel["type"] == "row":
            figure.text(*inches(x, y, w, h)[:2], panel["title"], color=TEXT, fontsize=13, weight="bold")
            continue
        frame = figure.add_axes(inches(x, y, w, h), facecolor=PANEL)
        frame.set_xticks([])
        frame.set_yticks([])
        for spine in frame.spines.values():
            spine.set_color(GRID)
        frame.text(0.08 / w, 1 - 0.05 / h, panel["title"], transform=frame.transAxes, color=TEXT, fontsize=10,
                   va="top")
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        if panel["type"] == "stat":
            drawn[panel["title"]] = _draw_stat(frame, prometheus, panel, end, unit)
            continue
        # The plot inside the frame: room for the title above, the tick labels left and below.
        ax = figure.add_axes(inches(x + 0.6, y + 0.32, w - 0.7, h - 0.68), facecolor=PANEL)
        for spine in ax.spines.values():
            spine.set_color(GRID)
        ax.tick_params(colors=TEXT, labelsize=7)
        drawn[panel["title"]] = _draw_timeseries(ax, prometheus, panel, start, end, unit)
    figure.savefig(path, dpi=80, facecolor=BACKGROUND)
    return drawn


def _draw_stat(ax, prometheus: PrometheusApi, panel: dict, at: float, unit: str) -> int:
    series = [s for target in panel["targets"] for s in prometheus.instant(target["expr"], at)]
    text = _format(series[0].values[-1], unit) if series else "No data"
    ax.text(0.5, 0.42, text, transform=ax.transAxes, ha="center", va="center", fontsize=26 if series else 12,
            color=COLORS[0] if series else "gray", weight="bold")
    return len(series)


def _draw_timeseries(ax, prometheus: PrometheusApi, panel: dict, start: float, end: float, unit: str) -> int:
    from matplotlib.dates import DateFormatter

    stacked = panel.get("fieldConfig", {}).get("defaults", {}).get("custom", {}).get("stacking", {}).get("mode") == "normal"
    lines, color = 0, 0
    baseline: dict[float, float] = {}
    for target in panel["targets"]:
        for series in prometheus.range(target["expr"], start, end):
            times = [datetime.fromtimestamp(t) for t in series.times]
            values = series.values
            if stacked:  # Grafana's normal stacking: each series on top of the ones before it
                below = [baseline.get(t, 0.0) for t in series.times]
                values = [b + v for b, v in zip(below, series.values, strict=True)]
                ax.fill_between(times, below, values, color=COLORS[color % len(COLORS)], alpha=0.5, linewidth=0)
                baseline.update(zip(series.times, values, strict=True))
            ax.plot(times, values, color=COLORS[color % len(COLORS)], linewidth=1.2,
                    label=legend(target.get("legendFormat", ""), series.labels))
            lines, color = lines + 1, color + 1
        if target.get("exemplar"):
            exemplars = prometheus.exemplars(target["expr"], start, end)
            if exemplars:
                ax.scatter([datetime.fromtimestamp(t) for t, _, _ in exemplars], [v for _, v, _ in exemplars],
                           marker="D", s=22, color="#e0e0e0", zorder=5, label="exemplar (trace_id)")
                t, v, labels = exemplars[-1]
                ax.annotate(f"trace {labels.get('trace_id', '')[:12]}…", (datetime.fromtimestamp(t), v),
                            xytext=(-10, 8), textcoords="offset points", ha="right", color=TEXT, fontsize=7)
    if lines:
        ax.legend(fontsize=7, loc="upper left", facecolor=PANEL, edgecolor=GRID, labelcolor=TEXT,
                  ncol=max(1, min(4, lines // 4 + 1)))
    else:
        ax.text(0.5, 0.5, "No data", transform=ax.transAxes, ha="center", va="center", color="gray")
    ax.set_xlim(datetime.fromtimestamp(start), datetime.fromtimestamp(end))
    ax.xaxis.set_major_formatter(DateFormatter("%H:%M:%S"))
    ax.grid(color=GRID, linewidth=0.6)
    if unit == "s":
        ax.yaxis.set_major_formatter(lambda value, _: f"{value:.3g} s")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="PNG to write")
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus base URL")
    parser.add_argument("--minutes", type=float, default=15, help="time range ending now")
    parser.add_argument("--rows", nargs="*", help="only these rows of the dashboard (titles)")
    args = parser.parse_args(argv)
    end = time.time()
    drawn = render_dashboard(PrometheusApi(args.prometheus), end - args.minutes * 60, end, args.output, rows=args.rows)
    print(f"{args.output}: {sum(1 for n in drawn.values() if n)} of {len(drawn)} panels with data")


if __name__ == "__main__":
    main()
