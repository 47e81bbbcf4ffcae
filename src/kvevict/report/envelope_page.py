"""The envelope's HTML page: the verdict sentence, the envelope table, the figure, the capacity table.

One self-contained file (the figure embedded), redrawn from the run folder's records alone.
"""

from __future__ import annotations

import html
from datetime import UTC, datetime
from pathlib import Path

from ..capacity import CapacityRow, gib
from ..records.schema import PplRecord
from .columns import Column, Table
from .envelope import EnvelopeRow, describe_tolerance, envelope_table, envelope_verdict
from .envelope_plot import envelope_figure
from .html import STYLE
from .markup import image_html, table_html
from .plots import png

HOW = (
    "Each configuration is bisected in log budget between the floor and the stream's length to the stated "
    "resolution; every probe is one streaming-perplexity cell against the full cache on the same tokens, judged "
    "by the tolerance rule: inside only when the whole paired 95% interval of the difference from the full cache "
    "lies inside the tolerance; undecided probes count as not inside. The answer is the smallest budget judged "
    "inside; \"first failing\" is the largest budget below it that was not. KV bytes are what the cache held at the "
    "end of the stream, in the dtype the model was loaded in."
)

CAPACITY: list[Column[CapacityRow]] = [
    Column("configuration", lambda r: r.name, "left"),
    Column("budget", lambda r: "full" if r.budget is None else str(r.budget)),
    Column("KV bytes / sequence", lambda r: gib(r.sequence_bytes)),
    Column("of full", lambda r: f"{100 * r.share:.1f}%"),
    Column("concurrent sequences", lambda r: str(r.sequences)),
]


def capacity_table(rows: list[CapacityRow]) -> Table:
    return Table.of(CAPACITY, rows)


def render_envelope(config: dict, full: PplRecord | None, rows: list[EnvelopeRow], tolerance, path: Path,
                    capacity: tuple[str, list[CapacityRow]] | None = None) -> Path:
    """Write the page to `path` (atomically) and return it. `capacity`: a heading line and its rows."""
    parts = [
        f"<h1>kvevict envelope: {html.escape(str(config.get('name', '')))}</h1>",
        f'<p class="meta">model {html.escape(str(config.get("model")))} · text {html.escape(str(config.get("text")))}'
        f" · {config.get('tokens')} tokens · positions {config.get('positions')} · floor {config.get('floor')} · "
        f"resolution {config.get('resolution')} · tolerance: {html.escape(describe_tolerance(tolerance))} · "
        f"generated {datetime.now(UTC):%Y-%m-%d %H:%M} UTC</p>",
        f'<div class="verdict"><p>{html.escape(envelope_verdict(full, rows, tolerance))}</p></div>',
        f"<p>{html.escape(HOW)}</p>",
    ]
    if rows and full is not None:
        parts += ["<h2>Envelope</h2>", table_html(envelope_table(rows), "envelope")]
        limit = tolerance.max_ppl_ratio
        parts += ["<h2>Quality against KV bytes</h2>",
                  image_html(png(envelope_figure(full, rows, limit)), "quality against KV bytes")]
    if capacity is not None:
        parts += ["<h2>Capacity</h2>", f"<p>{html.escape(capacity[0])}</p>",
                  table_html(capacity_table(capacity[1]), "capacity")]
    page = ("<!doctype html><html><head><meta charset='utf-8'><title>kvevict envelope</title>"
            f"<style>{STYLE}</style></head><body>{''.join(parts)}</body></html>")
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(path)
    return path
