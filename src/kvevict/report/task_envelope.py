"""The task envelope's cells judged, and its table and verdict (pure: records in, text out).

A cell is a configuration at a budget, answered on the first n seeded samples of a task by
it and by the full cache. It is judged by the tolerance rule's paired accuracy interval
(`stats.judge.judge` on the answers) at each look of the sampling schedule (`looks`: the sample
counts a cell is judged at) in turn, up to the largest look both answered; a cell still
undecided there needs the next look, unless it is at the cap. `ab/task_envelope.py` runs
the search these judgements steer.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, replace

from ..records.schema import RulerRecord
from ..stats.judge import Measured, judge
from ..stats.tolerance import Judgement, Tolerance
from .columns import Column, Table, number
from .kv_bytes import mib


@dataclass(frozen=True)
class Cell:
    """One probe: a configuration at a budget, judged at the largest look its answers cover."""

    spec: str
    budget: int
    judgement: Judgement | None  # None: no look answered yet
    need: int | None  # samples the next look needs; None: decided, or at the cap
    #: KV bytes per sequence at bf16 once the context was compressed, the mean over the judged samples, and the
    #: full cache's on the same samples (None where a record holds no byte figure)
    kv_bytes_bf16: float | None = None
    full_kv_bytes_bf16: float | None = None

    @property
    def inside(self) -> bool:
        return self.judgement is not None and self.judgement.outcome == "inside"


def scores(records: list) -> dict[tuple[str, str], dict[int, float]]:
    """(policy, budget label) -> sample -> score, from the run's task records."""
    out: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    for r in records:
        if isinstance(r, RulerRecord):
            out[r.policy, r.budget][r.sample] = r.score
    return out


def held_bytes(records: list) -> dict[tuple[str, str], dict[int, int | None]]:
    """(policy, budget label) -> sample -> KV bytes at bf16 the row's cache held once the context was compressed."""
    out: dict[tuple[str, str], dict[int, int | None]] = defaultdict(dict)
    for r in records:
        if isinstance(r, RulerRecord):
            out[r.policy, r.budget][r.sample] = r.kv_bytes_bf16
    return out


def _mean_bytes(by_sample: dict[int, int | None], n: int) -> float | None:
    sizes = [by_sample.get(i) for i in range(n)]
    return None if not sizes or None in sizes else sum(sizes) / n


def judge_cell(looks: list[int], tolerance: Tolerance, spec: str, budget: int, answered: dict, full: dict) -> Cell:
    """The cell judged at its first look that decides, or else at the largest look whose samples both it and the
    full cache answered. A cell stops at the look that decides it, as the sequential rule says: answers stored
    beyond it (a fixed-n grid or a `ruler` run in the same folder) are not read, so they cannot move the
    judgement."""
    judgement, need = None, looks[0]
    for n in looks:
        if not all(i in answered and i in full for i in range(n)):
            break
        judgement = judge(Measured(answers={"tasks": [answered[i] for i in range(n)]}),
                          Measured(answers={"tasks": [full[i] for i in range(n)]}), tolerance).deciding
        need = None if judgement.outcome != "undecided" or n == looks[-1] else next(m for m in looks if m > n)
        if judgement.outcome != "undecided":
            break
    return Cell(spec, budget, judgement, need)


def cells_of(looks: list[int], tolerance: Tolerance, spec: str, records: list) -> dict[int, Cell]:
    """Every budget the search of `spec` probed, judged."""
    found, sizes = scores(records), held_bytes(records)
    full = found.get(("full", "full"), {})
    out = {}
    for (policy, budget), answered in found.items():
        if policy == spec and budget != "full":
            cell = judge_cell(looks, tolerance, spec, int(budget), answered, full)
            if cell.judgement is not None:  # bytes over the very samples the judgement read
                n = cell.judgement.n
                cell = replace(cell, kv_bytes_bf16=_mean_bytes(sizes[policy, budget], n),
                               full_kv_bytes_bf16=_mean_bytes(sizes.get(("full", "full"), {}), n))
            out[int(budget)] = cell
    return out


def search_cost(records: list) -> tuple[int, float]:
    """(answers, seconds) the records took, the full cache's included."""
    answers = [r for r in records if isinstance(r, RulerRecord)]
    return len(answers), sum(r.seconds or 0.0 for r in answers)


def fixed_n_cost(records: list, n: int) -> int:
    """Answers a fixed-n grid needs to probe the same cells: n per probed cell plus n for the full cache."""
    probed = {(r.policy, r.budget) for r in records if isinstance(r, RulerRecord) and r.policy != "full"}
    return n * (len(probed) + 1)


def smallest(cells: dict[int, Cell]) -> tuple[Cell | None, Cell | None]:
    """The smallest budget shown inside, and the largest probed below it that is not (None where none)."""
    inside = [c for c in cells.values() if c.inside]
    best = min(inside, key=lambda c: c.budget) if inside else None
    below = [c for c in cells.values() if not c.inside and (best is None or c.budget < best.budget)]
    return best, max(below, key=lambda c: c.budget) if below else None


def at_cap(cells: dict[int, Cell]) -> list[Cell]:
    """The cells that reached the cap undecided."""
    return sorted((c for c in cells.values()
                   if c.need is None and c.judgement is not None and c.judgement.outcome == "undecided"),
                  key=lambda c: c.budget)


@dataclass(frozen=True)
class TaskRow:
    """One configuration's search on a task: every cell probed, judged."""

    name: str
    cells: dict[int, Cell]
    context: int  # tokens of the shortest context searched (the bracket's top)

    @property
    def smallest(self) -> Cell | None:
        return smallest(self.cells)[0]

    @property
    def failing(self) -> Cell | None:
        return smallest(self.cells)[1]


def drop(cell: Cell | None) -> str:
    """A cell's accuracy drop against the full cache with its interval, in points, e.g. `0.0 [0.0, 4.2]`; under
    the ratio rule its accuracy ratio, e.g. `0.97 [0.88, 1.04]`."""
    if cell is None or cell.judgement is None:
        return "-"
    j = cell.judgement
    if j.reason is not None:
        return "undefined"
    if j.metric == "accuracy-ratio":
        return f"{1 - j.estimate:.2f} [{1 - j.high:.2f}, {1 - j.low:.2f}]"
    return f"{100 * j.estimate:.1f} [{100 * j.low:.1f}, {100 * j.high:.1f}]"


def _said(cell: Cell) -> str:
    """`drop 0.0 [0.0, 4.2] points` or `ratio 0.97 [0.88, 1.04]`: `drop` with its words."""
    if cell.judgement is not None and cell.judgement.metric == "accuracy-ratio":
        return f"ratio {drop(cell)}"
    return f"drop {drop(cell)} points"


def _n(cell: Cell | None) -> str:
    return "-" if cell is None or cell.judgement is None else str(cell.judgement.n)


def _of_context(row: TaskRow) -> str:
    return "-" if row.smallest is None else f"{100 * row.smallest.budget / row.context:.1f}%"


def _mib(cell: Cell | None) -> str:
    return mib(cell.kv_bytes_bf16 if cell is not None else None)


def _of_full(cell: Cell | None) -> str:
    """The cell's bytes over the full cache's on the same samples (both at bf16)."""
    if cell is None or cell.kv_bytes_bf16 is None or not cell.full_kv_bytes_bf16:
        return "-"
    return f"{100 * cell.kv_bytes_bf16 / cell.full_kv_bytes_bf16:.1f}%"


def _columns(quality: str) -> list[Column[TaskRow]]:
    """The table's columns; `quality` heads the judged figure's (the drop in points, or the ratio)."""
    return [
        Column("configuration", lambda r: r.name, "left"),
        Column("smallest inside", lambda r: number(r.smallest and r.smallest.budget)),
        Column("of context", _of_context),
        Column("KV MiB/seq (bf16)", lambda r: _mib(r.smallest), drop=5),
        Column("of full (bytes)", lambda r: _of_full(r.smallest), drop=5),
        Column(quality, lambda r: drop(r.smallest)),
        Column("n", lambda r: _n(r.smallest)),
        Column("first failing", lambda r: number(r.failing and r.failing.budget), drop=2),
        Column("outcome there", lambda r: r.failing.judgement.outcome if r.failing and r.failing.judgement else "-",
               drop=3),
        Column("n ", lambda r: _n(r.failing), drop=4),
        Column("undecided at the cap", lambda r: ", ".join(str(c.budget) for c in at_cap(r.cells)) or "-", drop=1),
    ]


def task_rows(specs: list[str], labels: dict[str, str], looks: list[int], tolerance: Tolerance, records: list,
              context: int) -> list[TaskRow]:
    return [TaskRow(labels.get(spec, spec), cells_of(looks, tolerance, spec, records), context) for spec in specs]


def task_envelope_table(rows: list[TaskRow]) -> Table:
    """Configuration -> smallest budget inside, its share of the context, the drop (or the ratio) there with n,
    the first failure, and the cells that reached the cap undecided."""
    ratio = any(c.judgement is not None and c.judgement.metric == "accuracy-ratio" for r in rows
                for c in r.cells.values())
    return Table.of(_columns("ratio there [CI]" if ratio else "drop there, points [CI]"), rows)


def task_verdict(rows: list[TaskRow], tolerance: Tolerance, task: str, length: int) -> str:
    """The sentence: the cheapest configuration inside the tolerance (the fewest KV bytes where every record holds
    them, a quantized configuration holding fewer at the same entries; else the fewest entries), or the closest."""
    rule = (f"accuracy at least {100 * tolerance.min_accuracy_ratio:g}% of the full cache's"
            if tolerance.min_accuracy_ratio is not None else
            f"accuracy at most {100 * tolerance.max_accuracy_drop:g} points below the full cache's")
    limit = f"{rule}, the whole paired {100 * tolerance.confidence:.3g}% interval at each look"
    inside = [r for r in rows if r.smallest is not None]
    by_bytes = bool(inside) and all(r.smallest.kv_bytes_bf16 is not None for r in inside)
    inside.sort(key=lambda r: (r.smallest.kv_bytes_bf16 if by_bytes else 0, r.smallest.budget))
    if not inside:
        probed = [c for r in rows for c in r.cells.values() if c.judgement is not None]
        if not probed:
            return "Nothing measured yet: rerun the same command to continue the search."
        best = min(probed, key=lambda c: c.judgement.high if c.judgement.reason is None else math.inf)
        return (f"No configuration is within tolerance ({limit}) on {task} at {length} tokens; the closest is "
                f"{best.spec} at {best.budget} entries ({_said(best)}, {best.judgement.outcome}, "
                f"n = {best.judgement.n}).")
    top = inside[0]
    held = (f", {_mib(top.smallest)} MiB a sequence at bf16, {_of_full(top.smallest)} of the full cache's bytes"
            if by_bytes and top.smallest.full_kv_bytes_bf16 else "")
    return (f"Within tolerance ({limit}) on {task} at {length} tokens, the cheapest configuration "
            f"({'fewest KV bytes' if by_bytes else 'fewest entries'}) is {top.name} at {top.smallest.budget} entries "
            f"({_of_context(top)} of the context{held}; {_said(top.smallest)}, n = {top.smallest.judgement.n}).")

