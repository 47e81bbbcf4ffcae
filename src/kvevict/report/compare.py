"""Several runs side by side: one row per (policy, budget) found in any run, one group of columns per run.

Typically the same sweep on two models. Each run's cells are its own summary rows
(`tables.summary_rows`: PPL and PPL / full against that run's full cache), its sink
loss (`PplRecord.sink_share`: the share of bounded (layer, KV head) pairs that lost token 0) and, when
the run holds a needle test, its mean pass-key accuracy. The table is an ordinary
`Table` of `Column`s, so HTML and Markdown render it like every other table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..records.schema import ppl_records, task_records
from .columns import Column, Table, number
from .runs import Run
from .tables import KIND_ORDER, SummaryRow, ppl_text, summary_rows
from .verdict import needle_means


@dataclass(frozen=True)
class RunCell:
    """One run's numbers for one row of the comparison (None: the run has no such number)."""

    ppl: str  # as the tables show it (`tables.ppl_text`)
    ppl_over_full: float | None
    sink_loss: float | None
    passkey: float | None


@dataclass
class CompareRow:
    """A policy as labelled at a budget (None: the full cache), and each run's cell by run index."""

    name: str
    budget: int | None
    kind: str
    cells: dict[int, RunCell] = field(default_factory=dict)


def _cell(row: SummaryRow, passkeys: dict[tuple[str, str], float]) -> RunCell:
    r = row.record
    budget = "full" if r.budget is None else str(r.budget)
    return RunCell(ppl_text(r), row.ppl_over_full if r.enough else None, r.sink_share, passkeys.get((r.name, budget)))


def compare_rows(runs: Sequence[Run]) -> list[CompareRow]:
    """Every (policy label, budget) of any run: the full cache first, then by budget, kind and name."""
    rows: dict[tuple[str, int | None], CompareRow] = {}
    for index, run in enumerate(runs):
        passkeys = needle_means(run.records)
        for summary in summary_rows(ppl_records(run.records)):
            r = summary.record
            row = rows.setdefault((r.name, r.budget), CompareRow(r.name, r.budget, r.kind))
            row.cells[index] = _cell(summary, passkeys)
    return sorted(rows.values(), key=lambda row: (row.budget or 0, KIND_ORDER[row.kind], row.name))


def _run_columns(index: int, name: str, needle: bool) -> list[Column[CompareRow]]:
    """The column group of run `index`: `-` where that run lacks the row."""

    def value(row: CompareRow, attribute: str) -> object:
        cell = row.cells.get(index)
        return None if cell is None else getattr(cell, attribute)

    columns = [
        Column(f"{name} ppl", lambda row: value(row, "ppl") or "-"),
        Column(f"{name} ppl / full", lambda row: number(value(row, "ppl_over_full"))),
        Column(f"{name} sink loss", lambda row: number(value(row, "sink_loss"))),
    ]
    if needle:
        columns.append(Column(f"{name} pass-key", lambda row: number(value(row, "passkey"))))
    return columns


def compare_table(runs: Sequence[Run], names: Sequence[str]) -> Table:
    """The side-by-side table; `names[i]` heads run i's columns (see `runs.run_names`)."""
    columns: list[Column[CompareRow]] = [
        Column("policy", lambda row: row.name, align="left"),
        Column("budget", lambda row: number(row.budget)),
    ]
    for index, (run, name) in enumerate(zip(runs, names)):
        columns += _run_columns(index, name, bool(task_records(run.records, "needle")))
    return Table.of(columns, compare_rows(runs))
