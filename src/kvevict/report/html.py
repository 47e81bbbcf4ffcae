"""The self-contained HTML report: a header, then every section of `sections.SECTIONS` in order.

One file, plots embedded as base64, so it can be attached to a ticket or opened from a
CI artifact with no server and no network.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from .records import Record
from .sections import SECTIONS

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


def render(records: Sequence[Record], config: dict, path: Path) -> Path:
    """Write the report for `records` (typed, see `report.records`) to `path` and return it.

    `config` is the run's settings as recorded in `run.json` (any missing key shows as None).
    """
    parts = [
        f"<h1>kvevict A/B report: {html.escape(str(config.get('name', '')))}</h1>",
        '<p class="meta">'
        + html.escape(
            f"model {config.get('model')} · text {config.get('text')} · {config.get('tokens')} tokens · "
            f"positions {config.get('positions')} · seed {config.get('seed')} · "
            f"generated {datetime.now(UTC):%Y-%m-%d %H:%M} UTC"
        )
        + "</p>",
    ]
    for section in SECTIONS:
        found = section(records)
        if found:
            parts += [f"<h2>{html.escape(found[0])}</h2>", found[1]]
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>kvevict report</title>"
        f"<style>{STYLE}</style></head><body>{''.join(parts)}</body></html>"
    )
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(path)
    return path
