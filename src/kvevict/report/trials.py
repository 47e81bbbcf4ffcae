"""The report's section for the trials of sweep tasks it has no section of its own for.

A sweep task (`ab/sweep_tasks/`) may write trials of a kind the report was never told of: its lines say they are
trials (`records.schema.TRIAL`) and read back as `TaskRecord`s. This section draws each such kind as a table, one
row per trial and one column per field holding a single value, so a new task is readable in the report with
nothing written here; a task that wants a figure of its own adds a section beside the others.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from ..records.schema import TASK_KINDS, Record, TaskRecord
from .columns import Table, number
from .markup import table_html

#: the fields a trial table starts with where its trials have them (what every sweep trial is of)
LEADING = ("policy", "budget")
#: a text cell longer than this is cut (a generated answer would swamp the table)
LONGEST_TEXT = 80


def _scalar(value: object) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def _cell(value: object) -> str:
    text = number(value)
    return text if len(text) <= LONGEST_TEXT else text[: LONGEST_TEXT - 1] + "…"


def trial_table(trials: Sequence[TaskRecord]) -> Table:
    """Every trial as one row, in the order written; a column per field (`LEADING` first, then as first seen)
    whose every value is a scalar: a list or a mapping has no cell (`results.jsonl` keeps it)."""
    seen = dict.fromkeys(name for t in trials for name in t.fields)
    names = [n for n in LEADING if n in seen] + [n for n in seen if n not in LEADING]
    names = [n for n in names if all(_scalar(t.fields.get(n)) for t in trials)]
    texts = {n for n in names if any(isinstance(t.fields.get(n), str) for t in trials)}
    return Table(names, [[_cell(t.fields.get(n)) for n in names] for t in trials],
                 ["left" if n in texts else "right" for n in names])


def other_trials(records: Sequence[Record]) -> tuple[str, str] | None:
    """A heading and a table per trial kind beyond needle and generation, in the order first written; None
    when the run holds none."""
    kinds: dict[str, list[TaskRecord]] = {}
    for r in records:
        if isinstance(r, TaskRecord) and r.kind not in TASK_KINDS:
            kinds.setdefault(r.kind, []).append(r)
    if not kinds:
        return None
    parts = [f"<h3>{html.escape(kind)}</h3>" + table_html(trial_table(trials), html.escape(f"trials-{kind}"))
             for kind, trials in kinds.items()]
    return "Other tasks: every trial", "".join(parts)
