"""The sections of the HTML report, in page order: `SECTIONS` is the whole list.

A section takes every record of the run and returns `(title, html body)`, or None
when the run holds nothing for it (no sink sweep, no needle test, ...). Sections only
render records; they never run anything, so a report is redrawn from `results.jsonl`
alone. A new protocol adds its section function here and one entry to `SECTIONS`; a sweep task's trials
of a kind with no section here are drawn by `trials.other_trials`, so a task needs none.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence

from ..eval.generation import GenerationResult
from ..eval.needle import NeedleResult
from ..records.schema import Record, SinkMapRecord, ppl_records, ruler_records, task_records
from . import plots, ruler_plots, task_plots, verdict, verdict_text
from . import ruler as ruler_report
from .kv_bytes import EQUAL_BYTES, equal_bytes
from .markup import image_html, table_html
from .tables import generation_table, layer_budget_table, needle_table, sinks_table, summary_table
from .task_bytes import task_equal_bytes
from .trials import other_trials

Section = Callable[[Sequence[Record]], tuple[str, str] | None]

PPL_INTRO = (
    "<p>Each policy keeps at most <em>budget</em> entries per layer and KV head. KL is "
    "KL(full ‖ policy) of the next-token distributions on the same tokens; sink loss is the share "
    "of (layer, KV head) pairs the budget bounds that no longer hold token 0 at the end (a model's own "
    "sliding-window layers are not counted: they lose token 0 by design once the stream passes their window). "
    "The oracle re-computes each "
    "scored token from its previous <em>budget</em> tokens; with a stride it scores every K-th token, so its "
    "PPL is a sampled estimate (shown only from 30 re-computed predictions on) and its <em>ppl / full</em> "
    "compares it with the full cache on the very same "
    "tokens. <em>batch seconds</em> is the wall time of the batch a row ran in (the policies of one budget share a "
    "batch), <em>tokens/s</em> the stream tokens that batch read per second, and <em>peak MB</em> the peak "
    "resident memory of the process (the sweep, or its Ray worker) while the batch ran. <em>KV MiB/seq</em> is "
    "the keys and values a sequence held at the end of the stream, as held (the run's dtype), and <em>bf16</em> the "
    "same with every float at 2 bytes (the deployment dtype; a quantized row's codes keep their size).</p>"
)


def decision(records: Sequence[Record]) -> tuple[str, str] | None:
    """The verdict first: what to ship at each budget, and what to avoid (see `verdict`)."""
    found = verdict.verdict(records)
    return ("Verdict", verdict_text.section_html(found)) if found else None


def at_equal_bytes(records: Sequence[Record]) -> tuple[str, str] | None:
    """Rows of different KV widths that hold equal bytes, compared paired (see `kv_bytes`); absent without them."""
    found = equal_bytes(ppl_records(records))
    if not found:
        return None
    intro = (f"<p>Rows whose KV bytes per sequence at bf16 lie within {EQUAL_BYTES:.0%} of each other, across "
             "budgets and widths: fewer entries against fewer bits at the same memory. Each row's PPL against the "
             "group's lowest, with its paired 95% interval over the same blocks of tokens.</p>")
    return "At equal bytes", intro + "".join(f"<p>{html.escape(g.sentence())}</p>" for g in found)


def perplexity(records: Sequence[Record]) -> tuple[str, str] | None:
    """Present whenever the run holds perplexity cells (a sweep always does; a `kvevict ruler` run does not)."""
    if not ppl_records(records):
        return None
    table = table_html(summary_table(ppl_records(records)), "summary")
    return "Streaming perplexity and fidelity to the full cache", PPL_INTRO + table


def sinks(records: Sequence[Record]) -> tuple[str, str] | None:
    table = sinks_table(ppl_records(records))
    if table is None:
        return None
    return "Attention sinks: perplexity vs pinned sink tokens", table_html(table, "sinks")


def layer_budgets(records: Sequence[Record]) -> tuple[str, str] | None:
    table = layer_budget_table(ppl_records(records))
    if table is None:
        return None
    intro = (
        "<p>Policies that give each layer its own budget (PyramidKV: more entries in low layers) hold this "
        "many entries per KV head in each layer, bottom first; together as many as <em>budget</em> in every "
        "layer. They run in a batch of their own: a layer stores one budget for all rows of a batch.</p>"
    )
    return "Budget per layer", intro + table_html(table, "layer-budgets")


def _figure(title: str, draw: Callable) -> Section:
    """A section holding one figure of the perplexity records (absent when `draw` has nothing to draw)."""

    def section(records: Sequence[Record]) -> tuple[str, str] | None:
        rows = ppl_records(records)
        fig = draw(rows) if rows else None
        return None if fig is None else (title, image_html(plots.png(fig), title))

    section.__name__ = draw.__name__
    return section


def needle(records: Sequence[Record]) -> tuple[str, str] | None:
    trials = [r.fields for r in task_records(records, "needle")]
    if not trials:
        return None
    cells = NeedleResult(records=trials).cells()
    parts = [table_html(needle_table(cells), "needle")]
    parts += [image_html(plots.png(fig), title) for title, fig in task_plots.needle_heatmaps(cells)]
    return "Pass-key retrieval (needle in the essays)", "".join(parts)


def generation(records: Sequence[Record]) -> tuple[str, str] | None:
    trials = [r.fields for r in task_records(records, "generation")]
    if not trials:
        return None
    rows = GenerationResult(records=trials).summary()
    body = table_html(generation_table(rows), "generation")
    body += image_html(plots.png(task_plots.generation_figure(rows)), "generation")
    return "Generation failure modes: repetition and recall", body


def sink_map(records: Sequence[Record]) -> tuple[str, str] | None:
    found = next((r for r in records if isinstance(r, SinkMapRecord)), None)
    if found is None:
        return None
    data = dict(found.map, model=found.model)
    names = ", ".join(f"{html.escape(s['token'])}@{s['position']}" for s in data.get("sinks", [])) or "none"
    figure = image_html(plots.png(task_plots.sink_map_figure(data)), "sink map")
    return "Attention-sink map", f"<p>positions acting as sinks: {names}</p>" + figure


RULER_INTRO = (
    "<p>RULER's synthetic tasks (generated offline; see docs/tasks.md). Each cell: mean score over its answers "
    "(RULER's string_match_all: the share of the references found; QA: any reference) and its 95% Wilson "
    "interval, counting a fractional score as that many successes of one trial per answer. <em>n</em>: answers "
    "per cell. † marks a task where the full cache scores below {floor:.0%} at that length: beyond this model at "
    "this length, shown but left out of the rank correlation. Protocols: <em>agnostic</em> compresses the "
    "context, then reads the question; <em>aware</em> compresses the question too; <em>stream</em> evicts while "
    "reading; <em>multi</em> asks several questions of one compressed context (requests: each from the same "
    "state; turns: a dialogue, evicting throughout; aware-requests: the first question compressed with the "
    "context, every later one served from that state).</p>"
)


def ruler(records: Sequence[Record]) -> tuple[str, str] | None:
    found = ruler_report.cells(ruler_records(records))
    if not found:
        return None
    parts = [RULER_INTRO.format(floor=ruler_report.FLOOR), table_html(ruler_report.ruler_table(found), "ruler")]
    held = ruler_report.bytes_table(found)
    if held is not None:  # what each cell's cache held: fewer entries and fewer bits compared in bytes
        parts += ["<p>KV bytes per sequence once the context was compressed, at bf16 (MiB, the mean over the "
                  "cell's prompts).</p>", table_html(held, "ruler-bytes")]
        same = task_equal_bytes(ruler_records(records))  # fewer entries against fewer bits, same memory
        if same:
            parts.append('<ul class="equal-bytes">' + "".join(f"<li>{html.escape(g.sentence())}</li>" for g in same)
                         + "</ul>")
    agreement = ruler_report.rank_agreement(ppl_records(records), ruler_records(records))
    if agreement:
        rows = [f"<li>{html.escape(a['protocol'])}, budget {html.escape(a['budget'])}: Spearman ρ = "
                + ("n/a (no spread)" if a["rho"] is None else f"{a['rho']:+.2f}")
                + f" over {html.escape(', '.join(a['policies']))}</li>" for a in agreement]
        parts.append("<p>Does perplexity rank the policies as the tasks do? Rank correlation between -PPL and "
                     "mean task accuracy (tasks within reach), per budget:</p><ul>" + "".join(rows) + "</ul>")
    elif ppl_records(records):
        parts.append("<p>No rank correlation with perplexity: no budget holds two policies in both the perplexity "
                     "cells and a task within this model's reach.</p>")
    figures = ruler_plots.heatmaps(found) + ruler_plots.accuracy_vs_budget(found)
    parts += [image_html(plots.png(fig), title) for title, fig in figures]
    return "RULER tasks: accuracy per task, policy and budget", "".join(parts)


SECTIONS: list[Section] = [
    decision,
    perplexity,
    sinks,
    layer_budgets,
    at_equal_bytes,
    _figure("Perplexity along the stream", plots.ppl_vs_position),
    _figure("Perplexity vs budget", plots.ppl_vs_budget),
    _figure("Perplexity vs number of sinks", plots.ppl_vs_sinks),
    _figure("Sink loss per layer and KV head", plots.sink_loss_heatmaps),
    needle,
    generation,
    sink_map,
    ruler,
    other_trials,
]
