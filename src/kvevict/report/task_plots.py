"""Figures for the protocols beyond perplexity, as matplotlib Figures (`plots.png` makes the bytes).

Each function takes the plain records the library returns (`NeedleResult.cells()`,
`SinkMap.to_dict()`, `GenerationResult.summary()`), so figures can be redrawn from a
results store without the model.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from .tables import budget_order  # noqa: E402


def needle_heatmaps(cells: list[dict]) -> list[tuple[str, Figure]]:
    """One figure per policy: a depth x length accuracy heatmap for each budget, side by side."""
    figures = []
    policies = list(dict.fromkeys(c["policy"] for c in cells))
    lengths = sorted({c["length"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    for policy in policies:
        mine = [c for c in cells if c["policy"] == policy]
        budgets = sorted({str(c["budget"]) for c in mine}, key=budget_order)
        fig, axes = plt.subplots(1, len(budgets), figsize=(1.2 + 1.3 * len(lengths) * len(budgets), 3.2),
                                 squeeze=False)
        for ax, budget in zip(axes[0], budgets, strict=True):
            grid = np.full((len(depths), len(lengths)), np.nan)
            trials = np.zeros_like(grid)
            for c in mine:
                if str(c["budget"]) == budget:
                    grid[depths.index(c["depth"]), lengths.index(c["length"])] = c["accuracy"]
                    trials[depths.index(c["depth"]), lengths.index(c["length"])] = c["trials"]
            ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            for i in range(len(depths)):
                for j in range(len(lengths)):
                    if not np.isnan(grid[i, j]):
                        ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8)
            ax.set_xticks(range(len(lengths)), [str(v) for v in lengths])
            ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
            ax.set_xlabel("haystack tokens")
            ax.set_ylabel("needle depth")
            ax.set_title(f"budget {budget}", fontsize=9)
        fig.suptitle(f"pass-key accuracy: {policy}", fontsize=10)
        figures.append((f"needle: {policy}", fig))
    return figures


def sink_map_figure(result: dict) -> Figure:
    """Three panels: layer x first-k share (mean over heads), layer x head share of the first k, and
    the mean share of every early position with the detected sinks named."""
    share = np.array(result["share"])  # [layers, heads, k]
    layers, heads, k = share.shape
    fig, axes = plt.subplots(1, 3, figsize=(15, 5.2), gridspec_kw={"width_ratios": [1.1, 1.0, 1.6]})
    ax = axes[0]
    image = ax.imshow(share.mean(axis=1), vmin=0, vmax=1, cmap="magma", aspect="auto")
    tokens = result.get("tokens") or [str(i) for i in range(k)]
    ax.set_xticks(range(k), [f"{i}\n{t!r}"[:14] for i, t in enumerate(tokens)], fontsize=6)
    ax.set_ylabel("layer")
    ax.set_title("attention share per leading position\n(mean over heads)", fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.046)
    ax = axes[1]
    image = ax.imshow(share.sum(axis=2), vmin=0, vmax=1, cmap="magma", aspect="auto")
    ax.set_xticks(range(heads), [str(h) for h in range(heads)], fontsize=7)
    ax.set_xlabel("query head")
    ax.set_ylabel("layer")
    ax.set_title(f"share on the first {k} positions\nper layer and head", fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.046)
    ax = axes[2]
    mean = np.array(result["position_mean"])
    shown = mean[: min(len(mean), 128)]
    ax.bar(range(len(shown)), shown, color="steelblue", width=1.0)
    ax.set_yscale("log")
    for sink in result["sinks"]:
        if sink["position"] < len(shown):
            ax.annotate(f"{sink['position']} {sink['token']!r}", (sink["position"], sink["mean_share"]),
                        fontsize=7, rotation=45, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("position")
    ax.set_ylabel("mean attention share (all layers, heads)")
    ax.set_title("mean attention share of each early position (sinks named)", fontsize=9)
    fig.suptitle(f"attention-sink map{': ' + result['model'] if 'model' in result else ''}", fontsize=11)
    fig.tight_layout()
    return fig


def generation_figure(rows: list[dict]) -> Figure:
    """Repetition rate and recall per policy, one group of bars per budget."""
    labels = [f"{r['policy']}\n{r['budget']}" for r in rows]
    x = np.arange(len(rows))
    fig, axes = plt.subplots(1, 2, figsize=(max(6.0, 1.1 * len(rows) * 2), 3.6))
    axes[0].bar(x, [r["repetition"] for r in rows], color="indianred")
    axes[0].set_title("repeated 4-grams in the output (lower is better)", fontsize=9)
    axes[1].bar(x, [r["recall"] for r in rows], color="seagreen")
    axes[1].set_title("recall of the fact stated at the start (higher is better)", fontsize=9)
    for ax in axes:
        ax.set_xticks(x, labels, fontsize=7, rotation=30, ha="right")
        ax.set_ylim(0, 1)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig
