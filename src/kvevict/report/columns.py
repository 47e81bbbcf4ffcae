"""Column specs and the tables built from them: one definition per table, three renderings.

A table is declared once as a list of `Column`s (header, how to format a cell,
alignment, and when a narrow terminal may leave the column out). `Table.of` turns rows
of any type into strings; the terminal (`cli/tables.py`), the HTML report
(`report/markup.py`) and Markdown (`Table.markdown`) all render that same `Table`, so a
new column or a new number format is one edit, seen everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

Row = TypeVar("Row")
Align = Literal["left", "right"]


@dataclass(frozen=True)
class Column(Generic[Row]):
    """One column: `text(row)` is the cell as printed (numbers already formatted).

    `drop` orders what a narrow terminal leaves out: the column with the lowest number
    goes first, `None` is never left out. Numbers are never cut short; a terminal too
    narrow for the columns it must keep gets lines wider than itself instead.
    """

    header: str
    text: Callable[[Row], str]
    align: Align = "right"
    drop: int | None = None


@dataclass
class Table:
    """Headers, alignments and cells of one table, as strings, ready for any renderer."""

    headers: list[str]
    rows: list[list[str]]
    aligns: list[Align] = field(default_factory=list)
    drops: list[int | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        # a table built from bare headers: names left, numbers right (the first column names the row)
        if not self.aligns:
            self.aligns = ["left"] + ["right"] * (len(self.headers) - 1)
        if not self.drops:
            self.drops = [None] * len(self.headers)

    @classmethod
    def of(cls, columns: Sequence[Column[Row]], rows: Iterable[Row]) -> Table:
        return cls(
            headers=[c.header for c in columns],
            rows=[[c.text(row) for c in columns] for row in rows],
            aligns=[c.align for c in columns],
            drops=[c.drop for c in columns],
        )

    def markdown(self) -> str:
        """GitHub Markdown. The separator row stays plain (`---`) so tables pasted into docs do not change."""
        lines = ["| " + " | ".join(self.headers) + " |", "|" + "---|" * len(self.headers)]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines)


def number(value: object, digits: int = 2) -> str:
    """A cell: `-` for a missing value, floats to `digits` decimals, anything else as written."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


#: the headers of KV bytes per sequence at the end of the stream, as held (the run's dtype) and with every float at
#: 2 bytes (bf16, the deployment dtype), in MiB (`report.kv_bytes`)
KV_HELD = "KV MiB/seq"
KV_BF16 = "KV MiB/seq bf16"

#: the header of the entries a layer held on average over the stream; under burst eviction (an engine's
#: context shift, whole pages) it stays below "kept", the most ever held: the memory a policy actually saves
MEAN_KEPT = "mean kept"


def mean_kept(value: float | None) -> str:
    """The "mean kept" cell: whole entries (an average over steps, so a fraction says nothing), `-` when the
    record predates the figure."""
    return number(None if value is None else float(value), 0)
