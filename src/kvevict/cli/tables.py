"""Result tables in the terminal: never a truncated number.

A table (`report.columns.Table`) is printed at its natural width when stdout is a
file or a pipe (nothing to fit). When it must fit a width (`COLUMNS`, or the
terminal's), headers wrap at their spaces and policy names fold first; if the columns
still do not fit, they are left out in the order their `drop` numbers give (for the
A/B summary: seconds, kept, top-1 agree, sink loss, KL to full, ppl / full) and a note
on stderr names them. Columns that are never dropped keep their full width even when
that is wider than the terminal: a wrapped line is readable, `126.…` is not.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table as RichTable

from ..report.columns import Table
from .common import err

#: a rich table's frame per column (one space of padding on each side, one rule) and its left edge
FRAME_PER_COLUMN = 3
FRAME_EDGE = 1
#: names fold onto several lines rather than go below this width (the longest default name, streamingllm)
NAME_MIN = 12


def target_width() -> int | None:
    """The width to fit: `COLUMNS` when set, the terminal's when stdout is one; None for a file or pipe."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    if sys.stdout.isatty():
        return shutil.get_terminal_size().columns
    return None


@dataclass
class Layout:
    """Which columns are shown, at what content widths, and the headers of those left out."""

    shown: list[int]
    widths: list[int]
    dropped: list[str]

    @property
    def width(self) -> int:
        return _frame(self.widths)


def _frame(widths: list[int]) -> int:
    """Printed width of a rich table whose columns hold `widths` characters."""
    return sum(widths) + FRAME_PER_COLUMN * len(widths) + FRAME_EDGE


def layout(table: Table, limit: int | None) -> Layout:
    """Fit `table` into `limit` characters (None: no limit) without cutting a number."""
    count = len(table.headers)
    columns = [[row[i] for row in table.rows] for i in range(count)]
    natural = [max([len(table.headers[i]), *map(len, columns[i])]) for i in range(count)]
    if limit is None or _frame(natural) <= limit:
        return Layout(list(range(count)), natural, [])
    floor = []
    for i in range(count):
        word = max((len(w) for w in table.headers[i].split()), default=1)
        cells = min(natural[i], NAME_MIN) if table.aligns[i] == "left" else max(map(len, columns[i]), default=0)
        floor.append(max(word, cells))
    shown = list(range(count))
    droppable = sorted((d, i) for i, d in enumerate(table.drops) if d is not None)
    dropped = []
    while _frame([floor[i] for i in shown]) > limit and droppable:
        _, i = droppable.pop(0)
        shown.remove(i)
        dropped.append(table.headers[i])
    widths = {i: floor[i] for i in shown}
    spare = limit - _frame(list(widths.values()))
    # spare room goes to names first (less folding), then to headers, left to right
    for i in sorted(shown, key=lambda i: table.aligns[i] != "left"):
        grow = max(0, min(spare, natural[i] - widths[i]))
        widths[i] += grow
        spare -= grow
    return Layout(shown, [widths[i] for i in shown], dropped)


def show(table: Table, title: str) -> None:
    """Print `table` on stdout, fitted as the module docstring says."""
    limit = target_width()
    fit = layout(table, limit)
    rich = RichTable(title=title)
    for i, width in zip(fit.shown, fit.widths):
        rich.add_column(table.headers[i], justify=table.aligns[i], width=width, overflow="fold")
    for row in table.rows:
        rich.add_row(*(row[i] for i in fit.shown))
    Console(width=max(fit.width, limit or 0)).print(rich)
    if fit.dropped:
        err.print(
            f"note: {limit} columns are too few for every column: left out {', '.join(fit.dropped)} "
            "(widen the terminal or set COLUMNS to see them; a file or pipe gets them all)",
            markup=False, highlight=False, soft_wrap=True,
        )
