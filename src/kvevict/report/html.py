"""The self-contained HTML report: a header, then every section of `sections.SECTIONS` in order.

`render` draws one run; `render_compare` puts several side by side in one page (a
comparison table, every run's verdict, then each run's sections under its name).

One file, plots embedded as base64, so it can be attached to a ticket or opened from a
CI artifact with no server and no network.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from ..files import atomic_write
from ..records.schema import UNRECORDED_DTYPE, Record
from ..stats.tolerance import Tolerance
from .compare import compare_table
from .markup import table_html
from .runs import Run, run_names, run_notes, stream_start_label
from .sections import SECTIONS
from .verdict import verdict
from .verdict_text import section_html

COMPARE_INTRO = (
    "<p>One row per policy and budget found in any run; each run's columns: its streaming PPL, PPL over its own "
    "full cache, sink loss (share of (layer, KV head) pairs that evicted token 0) and, when the run holds a "
    "needle test, mean pass-key accuracy. <em>-</em>: the run has no such row.</p>"
)

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1200px; color: #222; }
table.results { border-collapse: collapse; margin: 1rem 0; font-size: 0.9rem; }
table.results th, table.results td { border: 1px solid #ccc; padding: 0.25rem 0.6rem; text-align: right; }
table.results td.left, table.results th.left { text-align: left; }
table.results thead { background: #f3f3f3; }
img.plot { max-width: 100%; }
.meta { color: #555; }
.verdict { border-left: 4px solid #2a6; padding: 0.1rem 0.8rem; margin: 0.6rem 0; background: #f6fbf7; }
"""


def _sections(records: Sequence[Record], level: int = 2, skip: tuple[str, ...] = ()) -> list[str]:
    """Every section the run holds something for, titled at heading `level`; `skip` names sections left out."""
    parts = []
    for section in SECTIONS:
        found = None if section.__name__ in skip else section(records)
        if found:
            parts += [f"<h{level}>{html.escape(found[0])}</h{level}>", found[1]]
    return parts


def _meta(text: str) -> str:
    return f'<p class="meta">{html.escape(text)}</p>'


def _write(parts: list[str], path: Path) -> Path:
    """The page, written atomically: a report being redrawn is never seen half written."""
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>kvevict report</title>"
        f"<style>{STYLE}</style></head><body>{''.join(parts)}</body></html>"
    )
    return atomic_write(path, page)


def render(records: Sequence[Record], config: dict, path: Path) -> Path:
    """Write the report for `records` (typed, see `records.schema`) to `path` and return it.

    `config` is the run's settings as recorded in `run.json` (any missing key shows as None); its `tolerance`
    is what the verdict judges against (the default where none is recorded).
    """
    tolerance = Tolerance.from_dict(config.get("tolerance"))
    found = verdict(records, tolerance)
    parts = [
        f"<h1>kvevict A/B report: {html.escape(str(config.get('name', '')))}</h1>",
        _meta(
            f"model {config.get('model')} · dtype {config.get('dtype') or UNRECORDED_DTYPE} · "
            f"text {config.get('text')} · {config.get('tokens')} tokens · "
            f"positions {config.get('positions')} · seed {config.get('seed')} · {stream_start_label(config)} · "
            f"generated {datetime.now(UTC):%Y-%m-%d %H:%M} UTC"
        ),
        _meta(f"tolerance: {tolerance.describe()}"),
        *(_meta(note) for note in run_notes(config)),
    ]
    if found:  # the verdict first, judged against the run's tolerance (the `decision` section with the default)
        parts += ["<h2>Verdict</h2>", section_html(found)]
    return _write(parts + _sections(records, skip=("decision",)), path)


def render_compare(runs: Sequence[Run], path: Path) -> Path:
    """One report for several runs (typically one sweep on several models), written to `path`.

    The side-by-side table first, then every run's verdict, then every run's own sections
    under a heading naming the run (its verdict is not repeated there). The header says
    what each run was measured on, and warns when that differs between runs.
    """
    names = run_names(runs)
    parts = [f"<h1>kvevict A/B report: {html.escape(' vs '.join(names))}</h1>"]
    parts += [_meta(f"{name}: {run.folder} · {run.dtype} · {run.measured_on()} · {run.tokenization()}")
              for name, run in zip(names, runs)]
    parts += [_meta(f"{name}: {note}") for name, run in zip(names, runs) for note in run.notes()]
    if len({run.measured_on() for run in runs}) > 1:
        parts.append(_meta("The runs were measured on different text, stream lengths, positions or seeds: "
                           "compare PPL / full rather than PPL across them."))
    parts.append(_meta(f"generated {datetime.now(UTC):%Y-%m-%d %H:%M} UTC"))
    parts += ["<h2>Side by side</h2>", COMPARE_INTRO, table_html(compare_table(runs, names), "compare")]
    for name, run in zip(names, runs):
        found = verdict(run.records, Tolerance.from_dict(run.config.get("tolerance")))
        body = section_html(found) if found else "<p>no budgets in this run</p>"
        parts += [f"<h2>Verdict: {html.escape(name)}</h2>", body]
    for name, run in zip(names, runs):
        parts += [f"<h2>{html.escape(name)}</h2>"] + _sections(run.records, level=3, skip=("decision",))
    return _write(parts, path)
