"""One trace drawn as a Gantt chart PNG, the way a trace viewer (Jaeger, Tempo) shows it: a row per span,
children under their parent and indented, a bar from the span's start to its end, coloured by service.
The README's trace picture is one training step's trace drawn this way from a test run's spans
(tests/deploy/test_prometheus_scrape.py, which receives them over OTLP)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlfabric.tools.render_dashboard import BACKGROUND, COLORS, GRID, PANEL, TEXT


@dataclass(frozen=True)
class TraceSpan:
    service: str
    name: str
    span_id: str
    parent_span_id: str  # "" for the root
    start_ns: int
    end_ns: int


def tree_order(spans: list[TraceSpan]) -> list[tuple[TraceSpan, int]]:
    """(span, depth), depth first from the root(s), siblings by start time."""
    ids = {span.span_id for span in spans}
    children: dict[str, list[TraceSpan]] = {}
    for span in spans:
        parent = span.parent_span_id if span.parent_span_id in ids else ""
        children.setdefault(parent, []).append(span)
    ordered: list[tuple[TraceSpan, int]] = []

    def visit(parent: str, depth: int) -> None:
        for span in sorted(children.get(parent, []), key=lambda s: (s.start_ns, s.name)):
            ordered.append((span, depth))
            visit(span.span_id, depth + 1)

    visit("", 0)
    return ordered


def short_name(name: str) -> str:
    """rlfabric.v1.RolloutService/GenerateStream -> RolloutService/GenerateStream."""
    return name.removeprefix("rlfabric.v1.")


def render_trace(spans: list[TraceSpan], path: Path, title: str = "") -> Path:
    """Draws the spans of one trace into `path` (PNG)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rows = tree_order(spans)
    origin = min(span.start_ns for span in spans)
    services = sorted({span.service for span in spans})
    color = {service: COLORS[i % len(COLORS)] for i, service in enumerate(services)}
    figure = Figure(figsize=(16, 1.2 + 0.24 * len(rows)), facecolor=BACKGROUND, layout="constrained")
    ax = figure.add_subplot(facecolor=PANEL)
    for row, (span, _depth) in enumerate(rows):
        start_ms, length_ms = (span.start_ns - origin) / 1e6, (span.end_ns - span.start_ns) / 1e6
        ax.barh(row, max(length_ms, 0.05), left=start_ms, height=0.7, color=color[span.service])
        ax.text(start_ms + length_ms, row, f" {length_ms:.1f} ms", va="center", fontsize=7, color=TEXT)
    labels = ["  " * depth + short_name(span.name) for span, depth in rows]
    ax.set_yticks(range(len(rows)), labels, fontsize=8, color=TEXT, fontfamily="monospace")
    # Left-aligned, so that a child's indent shows: the labels start a column's width left of the axis.
    ax.tick_params(axis="y", pad=4 + 0.6 * 8 * max(len(label) for label in labels))
    for label in ax.get_yticklabels():
        label.set_horizontalalignment("left")
    ax.invert_yaxis()  # the root on top
    ax.set_xlim(left=0)
    ax.set_xlabel("ms since the step started", color=TEXT)
    ax.tick_params(axis="x", colors=TEXT, labelsize=8)
    ax.grid(axis="x", color=GRID, linewidth=0.6)
    ax.set_axisbelow(True)
    for spine in ax.spines.values():
        spine.set_color(GRID)
    ax.legend(handles=[Patch(color=color[s], label=s) for s in services], loc="lower right", fontsize=8,
              bbox_to_anchor=(1, 1), ncol=len(services), facecolor=PANEL, edgecolor=GRID, labelcolor=TEXT)
    if title:
        ax.set_title(title, color=TEXT, loc="left")
    figure.savefig(path, dpi=90, facecolor=BACKGROUND)
    return path
