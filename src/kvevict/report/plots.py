"""Figures of a sweep, as matplotlib Figures; `png` turns one into bytes for the HTML report.

Each function takes the typed records of `results.jsonl` (`PplRecord`), so a report
can be redrawn from the store alone, long after the model is gone. They return the
Figure rather than its PNG so that what is drawn (series, axes, data) can be checked.
"""

from __future__ import annotations

import io
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from ..records.schema import PplRecord  # noqa: E402
from . import traits  # noqa: E402

#: legend text size (points): readable in the report at the figure's embedded width
LEGEND_SIZE = 8


def png(fig: Figure) -> bytes:
    """The figure as PNG bytes; closes it (pyplot keeps every open figure alive)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def _budgets(records: list[PplRecord]) -> list[int]:
    return sorted({r.budget for r in records if r.budget is not None})


def ppl_vs_position(records: list[PplRecord]) -> Figure:
    """StreamingLLM's figure: PPL along the stream, log scale, one panel per budget.

    Every panel has its own legend, below the plot so it hides no curve, and a policy
    keeps one colour in every panel, so any budget can be read on its own.
    """
    budgets = _budgets(records)
    full = next((r for r in records if r.kind == "full"), None)
    names = sorted({r.name for r in records if r.kind == "policy"})
    palette = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    colours = {name: palette(i % palette.N) for i, name in enumerate(names)}
    legend_rows = -(-(len(names) + 1) // 2)
    fig, axes = plt.subplots(1, max(1, len(budgets)), figsize=(5.2 * max(1, len(budgets)), 3.8 + 0.22 * legend_rows),
                             squeeze=False)
    for ax, budget in zip(axes[0], budgets):
        # the oracle scores a strided sample: too few tokens per window for a curve
        rows = [r for r in records if r.budget == budget and r.kind == "policy"]
        if full is not None:
            rows = [full] + rows
        for r in rows:
            xs = [p["end"] for p in r.curve]
            ys = [p["ppl"] for p in r.curve]
            style = {"color": "black", "linewidth": 2} if r.kind == "full" else {"color": colours[r.name]}
            ax.plot(xs, ys, label=r.name, **style)
        ax.set_yscale("log")
        ax.set_title(f"budget {budget}")
        ax.set_xlabel("token position")
        ax.set_ylabel("perplexity (window)")
        ax.axvline(budget, color="grey", linewidth=0.6, linestyle=":")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=LEGEND_SIZE, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    fig.suptitle("Perplexity along the stream")
    return fig


def ppl_vs_budget(records: list[PplRecord]) -> Figure:
    """One line per policy (and the oracle) over the budgets, the full cache as a horizontal line."""
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in records:
        if r.kind in ("policy", "oracle") and r.enough:
            series[r.name].append((r.budget, r.ppl))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, points in sorted(series.items()):
        points.sort()
        style = {"color": "grey", "linestyle": "--"} if name == "oracle" else {"marker": "o"}
        ax.plot([p[0] for p in points], [p[1] for p in points], label=name, **style)
    full = next((r for r in records if r.kind == "full"), None)
    if full is not None:
        ax.axhline(full.ppl, color="black", linewidth=2, label="full cache")
    ax.set_xscale("log", base=2)
    return _finish(ax, fig, "budget (entries per layer and KV head)", "Perplexity vs budget")


def ppl_vs_sinks(records: list[PplRecord]) -> Figure | None:
    """StreamingLLM's sink sweep: PPL over the number of pinned tokens, one line per budget."""
    rows = [r for r in records if r.kind == "sinks"]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for budget in _budgets(rows):
        points = sorted((traits.pinned(r.policy), r.ppl) for r in rows if r.budget == budget)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"budget {budget}")
    return _finish(ax, fig, "pinned sink tokens (sinkK+window)", "Perplexity vs number of attention sinks")


def _finish(ax, fig: Figure, xlabel: str, title: str) -> Figure:
    """Log-scale perplexity axis, labels, grid, legend: the common dress of the PPL plots."""
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("streaming perplexity")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return fig


def sink_loss_heatmaps(records: list[PplRecord]) -> Figure | None:
    """Layer x KV head: the share of the stream spent without token 0, per content-driven policy.

    Only policies that choose by what slots hold (attention, keys) can lose token 0 on
    some heads and keep it on others; a window loses it everywhere at once, so its map
    would say nothing.
    """
    rows = [r for r in records if r.kind == "policy" and traits.content_driven(r.policy) and r.sink_lost_at]
    if not rows:
        return None
    rows.sort(key=lambda r: (r.name, r.budget))
    cols = min(4, len(rows))
    lines = -(-len(rows) // cols)
    fig, axes = plt.subplots(lines, cols, figsize=(2.6 * cols, 3.9 * lines), squeeze=False)
    fig.subplots_adjust(hspace=0.55, wspace=0.35)
    image = None
    for ax, r in zip(axes.flat, rows):
        heads = max(len(layer) for layer in r.sink_lost_at if layer is not None)
        # [layers, heads], -1 = never; NaN (drawn blank) = a sliding layer the budget does not bound
        lost = np.array([[np.nan] * heads if layer is None else layer for layer in r.sink_lost_at], dtype=float)
        total = r.n_predictions + 1
        share = np.where(np.isnan(lost), np.nan, np.where(lost < 0, 0.0, (total - lost) / total))
        image = ax.imshow(share, aspect="auto", cmap="magma_r", vmin=0, vmax=1, interpolation="nearest")
        ax.set_title(f"{r.name}\nbudget {r.budget}: {r.sink_share:.0%} lost", fontsize=8)
        ax.set_xlabel("KV head", fontsize=7)
        ax.set_ylabel("layer", fontsize=7)
        ax.set_xticks(range(share.shape[1]))
    for ax in list(axes.flat)[len(rows) :]:
        ax.axis("off")
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.6, label="share of the stream without token 0")
    fig.suptitle("Where content-driven policies lost the attention sink")
    return fig
