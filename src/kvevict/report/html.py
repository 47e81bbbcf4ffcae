"""The self-contained HTML report: tables and base64-embedded plots in one file.

One file so it can be attached to a ticket or opened from a CI artifact with no
server and no network.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from . import plots
from .tables import COLUMNS, sinks_table, summary_rows

PPL_KINDS = ("full", "oracle", "policy", "sinks")
# Extra sections other protocols (needle, generation, sink map) can contribute:
# each takes the records and returns (title, html) or None.
SECTIONS: list[Callable[[list[dict]], tuple[str, str] | None]] = []


def table_html(header: list[str], rows: list[list[str]], table_id: str) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table id="{table_id}" class="results"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def image_html(data: bytes, alt: str) -> str:
    encoded = base64.b64encode(data).decode("ascii")
    return f'<figure><img class="plot" alt="{html.escape(alt)}" src="data:image/png;base64,{encoded}"></figure>'


STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1200px; color: #222; }
table.results { border-collapse: collapse; margin: 1rem 0; font-size: 0.9rem; }
table.results th, table.results td { border: 1px solid #ccc; padding: 0.25rem 0.6rem; text-align: right; }
table.results td:first-child, table.results th:first-child { text-align: left; }
table.results thead { background: #f3f3f3; }
img.plot { max-width: 100%; }
.meta { color: #555; }
"""


def render(records: list[dict], config: dict, path: Path) -> Path:
    """Write the report for `records` to `path` and return it."""
    from .. import extras  # noqa: F401  (registers the needle / generation / sink-map sections)

    all_records, records = records, [r for r in records if r.get("kind") in PPL_KINDS]
    parts = [
        f"<h1>kvevict A/B report: {html.escape(str(config.get('name', '')))}</h1>",
        '<p class="meta">'
        + html.escape(
            f"model {config.get('model')} · text {config.get('text')} · {config.get('tokens')} tokens · "
            f"positions {config.get('positions')} · seed {config.get('seed')} · "
            f"generated {datetime.now(UTC):%Y-%m-%d %H:%M} UTC"
        )
        + "</p>",
        "<h2>Streaming perplexity and fidelity to the full cache</h2>",
        "<p>Each policy keeps at most <em>budget</em> entries per layer and KV head. KL is "
        "KL(full ‖ policy) of the next-token distributions on the same tokens; sink loss is the share "
        "of (layer, KV head) pairs that no longer hold token 0 at the end. The oracle re-computes each "
        "scored token from its previous <em>budget</em> tokens; with a stride it scores every K-th token, so its "
        "PPL is a sampled estimate and its <em>ppl / full</em> compares it with the full cache on the very same "
        "tokens. <em>seconds</em> is the wall time of the batch a row ran in.</p>",
        table_html(COLUMNS, summary_rows(records), "summary"),
    ]
    sinks = sinks_table(records)
    if sinks:
        parts += ["<h2>Attention sinks: perplexity vs pinned sink tokens</h2>", table_html(*sinks, "sinks")]
    figures = [
        ("Perplexity along the stream", plots.ppl_vs_position(records)),
        ("Perplexity vs budget", plots.ppl_vs_budget(records)),
        ("Perplexity vs number of sinks", plots.ppl_vs_sinks(records)),
        ("Sink loss per layer and KV head", plots.sink_loss_heatmaps(records)),
    ]
    for title, data in figures:
        if data:
            parts += [f"<h2>{html.escape(title)}</h2>", image_html(data, title)]
    for section in SECTIONS:
        extra = section(all_records)
        if extra:
            parts += [f"<h2>{html.escape(extra[0])}</h2>", extra[1]]
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>kvevict report</title>"
        f"<style>{STYLE}</style></head><body>{''.join(parts)}</body></html>"
    )
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(path)
    return path
