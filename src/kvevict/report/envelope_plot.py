"""The envelope's figure: quality against KV bytes for every probe, the Pareto front, the tolerance line.

x: KV bytes held per sequence at the end of the stream (log scale); y: the judged metric's
estimate (PPL / full, or KL) with its paired 95% interval as an error bar. Filled markers
are probes inside the tolerance, hollow ones undecided, crosses outside. The full cache
is the point (its bytes, no loss). The Pareto front links the probes no other probe (or
the full cache) beats on both bytes and the estimate.
"""

from __future__ import annotations

from matplotlib.figure import Figure

from ..records.schema import PplRecord
from .envelope import EnvelopeRow, Probe
from .plots import LEGEND_SIZE

MARKERS = {"inside": ("o", True), "undecided": ("o", False), "outside": ("x", True)}


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both coordinates (lower is better on each), by ascending x."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(points, key=lambda p: (p[0], p[1])):
        if not front or y < front[-1][1]:
            front.append((x, y))
    return front


def _full_point(full: PplRecord, rows: list[EnvelopeRow]) -> tuple[float, float] | None:
    probes = [p for r in rows for p in r.probes if p.record.full_kv_bytes]
    if not probes:
        return None
    metric = probes[0].judgement.metric
    return float(probes[0].record.full_kv_bytes), (1.0 if "ratio" in metric else 0.0)


def envelope_figure(full: PplRecord, rows: list[EnvelopeRow], limit: float | None) -> Figure:
    """Every probe of every configuration; the front and the tolerance line (`limit`, None: no line)."""
    fig = Figure(figsize=(8, 4.8))
    ax = fig.subplots()
    points = []
    for index, row in enumerate(rows):
        colour = f"C{index % 10}"
        for probe in row.probes:
            _draw(ax, probe, colour)
            if probe.record.kv_bytes is not None:
                points.append((float(probe.record.kv_bytes), probe.judgement.estimate))
        ax.plot([], [], "o", color=colour, label=row.name)
    reference = _full_point(full, rows)
    if reference is not None:
        ax.plot(*reference, "*", color="black", markersize=11, label="full cache")
        points.append(reference)
    front = pareto(points)
    if front:
        ax.step([x for x, _ in front], [y for _, y in front], where="post", color="grey", linestyle="--",
                linewidth=1, label="Pareto front")
    if limit is not None:
        ax.axhline(limit, color="red", linewidth=1, label=f"tolerance {limit:g}")
    metric = rows[0].probes[0].judgement.metric if rows and rows[0].probes else "quality"
    ax.set_xscale("log")
    ax.set_xlabel("KV bytes held per sequence (end of stream)")
    ax.set_ylabel(metric.replace("_", " "))
    ax.set_title("Quality against KV bytes: every probe (filled inside, hollow undecided, x outside)")
    ax.legend(fontsize=LEGEND_SIZE)
    return fig


def _draw(ax, probe: Probe, colour: str) -> None:
    j, x = probe.judgement, probe.record.kv_bytes
    if x is None:
        return
    marker, filled = MARKERS.get(j.outcome, ("o", False))
    ax.errorbar([x], [j.estimate], yerr=[[j.estimate - j.low], [j.high - j.estimate]], fmt=marker, color=colour,
                markerfacecolor=colour if filled else "white", capsize=2, linewidth=1)
