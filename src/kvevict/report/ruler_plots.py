"""RULER figures: a task x policy heat map per protocol and budget, accuracy against budget per task.

Drawn from `report.ruler.cells`, so a run folder redraws without the model. Cells of a
task beyond the model at that length carry a dagger.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from .ruler import RulerCell  # noqa: E402
from .tables import budget_order  # noqa: E402


def heatmaps(found: list[RulerCell]) -> list[tuple[str, Figure]]:
    """One figure per protocol: a task@length x policy grid of accuracy for each budget, full cache first."""
    figures = []
    for protocol in dict.fromkeys(c.protocol for c in found):
        mine = [c for c in found if c.protocol == protocol]
        wheres = list(dict.fromkeys(c.where for c in mine))
        policies = [p for p in dict.fromkeys(c.policy for c in mine) if p != "full"]
        budgets = sorted({c.budget for c in mine if c.budget != "full"}, key=budget_order)
        if not budgets:
            continue
        full = {c.where: c for c in mine if c.budget == "full"}
        cols = ["full", *policies]
        fig, axes = plt.subplots(1, len(budgets), squeeze=False,
                                 figsize=(1.6 + 0.9 * len(cols) * len(budgets), 1.2 + 0.45 * len(wheres)))
        for ax, budget in zip(axes[0], budgets, strict=True):
            grid = np.full((len(wheres), len(cols)), np.nan)
            marks = [["" for _ in cols] for _ in wheres]
            for i, where in enumerate(wheres):
                row = {c.policy: c for c in mine if c.where == where and c.budget == budget}
                if where in full:
                    row["full"] = full[where]
                for j, policy in enumerate(cols):
                    if policy in row:
                        grid[i, j] = row[policy].accuracy
                        marks[i][j] = f"{row[policy].accuracy:.2f}" + ("†" if row[policy].beyond else "")
            ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
            for i in range(len(wheres)):
                for j in range(len(cols)):
                    ax.text(j, i, marks[i][j], ha="center", va="center", fontsize=7)
            ax.set_xticks(range(len(cols)), cols, rotation=35, ha="right", fontsize=7)
            ax.set_yticks(range(len(wheres)), wheres, fontsize=7)
            ax.set_title(f"budget {budget}", fontsize=9)
        fig.suptitle(f"RULER accuracy, protocol {protocol} († beyond the model at this length)", fontsize=10)
        fig.tight_layout()
        figures.append((f"ruler heat map: {protocol}", fig))
    return figures


def accuracy_vs_budget(found: list[RulerCell]) -> list[tuple[str, Figure]]:
    """One figure per protocol, one panel per task@length: each policy's accuracy (95% interval) per budget."""
    figures = []
    for protocol in dict.fromkeys(c.protocol for c in found):
        mine = [c for c in found if c.protocol == protocol]
        wheres = list(dict.fromkeys(c.where for c in mine))
        budgets = sorted({c.budget for c in mine if c.budget != "full"}, key=budget_order)
        if not budgets:
            continue
        columns = min(4, len(wheres))
        rows = -(-len(wheres) // columns)
        fig, axes = plt.subplots(rows, columns, squeeze=False, figsize=(3.4 * columns, 2.8 * rows))
        policies = [p for p in dict.fromkeys(c.policy for c in mine) if p != "full"]
        x = np.arange(len(budgets))
        for k, where in enumerate(wheres):
            ax = axes[k // columns][k % columns]
            for n, policy in enumerate(policies):
                pts = {c.budget: c for c in mine if c.where == where and c.policy == policy}
                xs = [i for i, b in enumerate(budgets) if b in pts]
                ys = np.array([pts[budgets[i]].accuracy for i in xs])
                err = np.array([[pts[budgets[i]].accuracy - pts[budgets[i]].low for i in xs],
                                [pts[budgets[i]].high - pts[budgets[i]].accuracy for i in xs]])
                ax.errorbar(np.array(xs) + 0.04 * (n - len(policies) / 2), ys, yerr=err, marker="o", ms=3,
                            capsize=2, lw=1, label=policy)
            full = next((c for c in mine if c.where == where and c.budget == "full"), None)
            if full is not None:
                ax.axhline(full.accuracy, color="black", ls="--", lw=1, label="full")
                ax.axhspan(full.low, full.high, color="black", alpha=0.08)
            beyond = full is not None and full.beyond
            ax.set_title(where + (" († beyond the model)" if beyond else ""), fontsize=8)
            ax.set_xticks(x, budgets, fontsize=7)
            ax.set_xlim(-0.5, len(budgets) - 0.5)
            ax.set_ylim(-0.05, 1.05)
            ax.grid(alpha=0.3)
        for k in range(len(wheres), rows * columns):
            axes[k // columns][k % columns].axis("off")
        axes[0][0].legend(fontsize=6)
        fig.suptitle(f"RULER accuracy against budget, protocol {protocol} (95% Wilson intervals)", fontsize=10)
        fig.tight_layout()
        figures.append((f"ruler accuracy vs budget: {protocol}", fig))
    return figures
