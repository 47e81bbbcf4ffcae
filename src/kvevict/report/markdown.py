"""The report as Markdown (`kvevict report --markdown`): the verdict, then the run's tables.

For several runs the side-by-side table comes first, then each run under its name, so
the text pasted into docs/results.md reads in the same order as the HTML report.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..records.schema import Record, ppl_records, ruler_records
from ..stats.tolerance import Tolerance
from .compare import compare_table
from .kv_bytes import equal_bytes
from .ruler import bytes_table, ruler_table
from .ruler import cells as ruler_cells
from .runs import Run, run_names
from .tables import layer_budget_table, sinks_table, summary_table
from .task_bytes import task_equal_bytes
from .verdict import verdict
from .verdict_text import markdown as verdict_markdown


def run_markdown(records: Sequence[Record], title: str = "Verdict", tolerance: Tolerance | None = None,
                 notes: Sequence[str] = ()) -> str:
    """One run: its verdict (against `tolerance`, the default if None) under `## title`, what it left out
    (`notes`, `runs.run_notes`), the summary table, then the sink and per-layer tables it holds."""
    rows = ppl_records(records)
    parts = [verdict_markdown(verdict(records, tolerance), title)] + [f"Note: {note}." for note in notes]
    parts += [group.sentence() for group in equal_bytes(rows)]  # fewer entries against fewer bits, same memory
    if rows:  # a run of tasks alone has no perplexity table (as in the HTML report)
        parts.append(summary_table(rows).markdown())
    parts += [extra.markdown() for extra in (sinks_table(rows), layer_budget_table(rows)) if extra]
    found = ruler_cells(ruler_records(records))
    if found:  # RULER answers: accuracy [95% interval] per task, budget and policy (see report.ruler)
        parts.append(ruler_table(found).markdown())
        held = bytes_table(found)
        if held is not None:
            parts.append(held.markdown())
            parts += [group.sentence() for group in task_equal_bytes(ruler_records(records))]
    return "\n\n".join(parts)


def compare_markdown(runs: Sequence[Run]) -> str:
    """Several runs: what each was measured on, the side-by-side table, then each run's `run_markdown`."""
    names = run_names(runs)
    measured = [f"- {name}: `{run.folder}`, {run.measured_on()} · {run.tokenization()}"
                for name, run in zip(names, runs)]
    parts = ["## Side by side", "\n".join(measured), compare_table(runs, names).markdown()]
    parts += [run_markdown(run.records, f"Verdict: {name}", Tolerance.from_dict(run.config.get("tolerance")),
                           run.notes()) for name, run in zip(names, runs)]
    return "\n\n".join(parts)
