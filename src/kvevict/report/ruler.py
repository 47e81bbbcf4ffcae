"""RULER results from the records: accuracy per cell with its binomial interval, and what is out of reach.

A cell is one protocol, task, length, policy and budget; its accuracy is the mean
score over its answers (samples, and questions under `multi`), with the 95% Wilson
interval. Where the full cache itself scores below `FLOOR` at a task and length, the
task is "beyond this model at this length": its cells are shown, marked, and left out
of every ranking, since a policy cannot lose what the model never had.

`rank_agreement` answers the first question a user asks of the tasks: does the
perplexity ranking of the policies say the same as the task ranking? Per budget,
Spearman's rank correlation between streaming PPL (lower is better) and mean task
accuracy over the tasks within reach (higher is better), over the policies both hold.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..eval.ruler.scoring import wilson
from .columns import Table
from .records import PplRecord, RulerRecord
from .tables import budget_order

#: below this full-cache accuracy a task is beyond the model at that length
FLOOR = 0.5


@dataclass
class RulerCell:
    protocol: str  # agnostic | aware | stream | multi-requests | multi-turns
    task: str
    length: int
    policy: str
    budget: str
    n: int
    accuracy: float
    low: float
    high: float
    beyond: bool = False

    @property
    def where(self) -> str:
        return f"{self.task}@{self.length}"


def cells(records: Iterable[RulerRecord], floor: float = FLOOR) -> list[RulerCell]:
    groups: dict[tuple, list[float]] = {}
    for r in records:
        groups.setdefault((r.shape, r.task, r.length, r.policy, r.budget), []).append(float(r.score))
    out = []
    for (shape, task, length, policy, budget), scores in groups.items():
        low, high = wilson(sum(scores), len(scores))
        out.append(RulerCell(shape, task, length, policy, budget, len(scores), sum(scores) / len(scores), low, high))
    full = {(c.protocol, c.task, c.length): c.accuracy for c in out if c.budget == "full"}
    for c in out:
        c.beyond = full.get((c.protocol, c.task, c.length), 1.0) < floor
    out.sort(key=lambda c: (c.protocol, c.task, c.length, budget_order(c.budget), c.policy))
    return out


def fmt(cell: RulerCell) -> str:
    return f"{cell.accuracy:.2f} [{cell.low:.2f}, {cell.high:.2f}]" + (" †" if cell.beyond else "")


def ruler_table(found: Sequence[RulerCell]) -> Table:
    """Rows: protocol, task@length, budget; columns: the full cache on the same prompts, then each policy:
    accuracy [95% interval]. A task with the full cache alone gets one row (budget `full`)."""
    policies = list(dict.fromkeys(c.policy for c in found if c.budget != "full"))
    full = {(c.protocol, c.where): c for c in found if c.budget == "full"}
    rows: dict[tuple, dict[str, RulerCell]] = {}
    for c in found:
        if c.budget != "full":
            rows.setdefault((c.protocol, c.where, c.budget), {})[c.policy] = c
    for protocol, where in full:
        if not any(k[:2] == (protocol, where) for k in rows):
            rows[(protocol, where, "full")] = {}
    body = []
    for (protocol, where, budget), row in rows.items():
        ref = full.get((protocol, where))
        n = max([c.n for c in row.values()] + ([ref.n] if ref else []))
        body.append([protocol, where, budget, str(n), fmt(ref) if ref else "-"]
                    + [fmt(row[p]) if p in row else "-" for p in policies])
    return Table(["protocol", "task@length", "budget", "n", "full"] + policies, body,
                 ["left", "left", "right", "right", "right"] + ["right"] * len(policies))


def _ranks(values: Sequence[float]) -> list[float]:
    """Average ranks (1 = smallest), ties sharing the mean of their places."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rho (Pearson correlation of average ranks); None when either side has no spread."""
    if len(a) < 2:
        return None
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va, vb = sum((x - ma) ** 2 for x in ra), sum((y - mb) ** 2 for y in rb)
    if va == 0 or vb == 0:
        return None
    return cov / math.sqrt(va * vb)


def rank_agreement(ppl: Sequence[PplRecord], found: Sequence[RulerCell]) -> list[dict]:
    """Per protocol and budget: the policies in both, their PPL and mean task accuracy, and Spearman's rho
    between -PPL and accuracy (+1: perplexity ranks the policies as the tasks do)."""
    by_budget: dict[str, dict[str, float]] = {}
    for r in ppl:
        if r.kind == "policy" and r.budget is not None:
            by_budget.setdefault(str(r.budget), {})[r.name] = r.ppl
    out = []
    for protocol in dict.fromkeys(c.protocol for c in found):
        for budget, ppls in by_budget.items():
            mine = [c for c in found if c.protocol == protocol and c.budget == budget and not c.beyond]
            acc: dict[str, list[float]] = {}
            for c in mine:
                acc.setdefault(c.policy, []).append(c.accuracy)
            both = [p for p in ppls if p in acc]
            if len(both) < 2:
                continue
            accuracy = [sum(acc[p]) / len(acc[p]) for p in both]
            rho = spearman([-ppls[p] for p in both], accuracy)
            out.append({"protocol": protocol, "budget": budget, "policies": both,
                        "ppl": [ppls[p] for p in both], "accuracy": accuracy, "rho": rho})
    return out
