"""HTML fragments of the report: a `Table` as an HTML table, a PNG as an embedded image."""

from __future__ import annotations

import base64
import html

from .columns import Table


def _cell(tag: str, text: str, align: str) -> str:
    style = ' class="left"' if align == "left" else ""
    return f"<{tag}{style}>{html.escape(text)}</{tag}>"


def table_html(table: Table, table_id: str) -> str:
    """The table with its column alignments (numbers right, names left); `table_id` lets tests and CSS find it."""
    head = "".join(_cell("th", h, a) for h, a in zip(table.headers, table.aligns))
    body = "".join(
        "<tr>" + "".join(_cell("td", c, a) for c, a in zip(row, table.aligns)) + "</tr>" for row in table.rows
    )
    return f'<table id="{table_id}" class="results"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def image_html(data: bytes, alt: str) -> str:
    """A PNG embedded as base64: the report stays one file that opens with no server and no network."""
    encoded = base64.b64encode(data).decode("ascii")
    return f'<figure><img class="plot" alt="{html.escape(alt)}" src="data:image/png;base64,{encoded}"></figure>'
