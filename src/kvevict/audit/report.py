"""The audit's HTML report, like `ab`'s: the verdict, the streams' table, fidelity along the stream with the
eviction events marked, and the reproduction beside it where one was run. One file, the plot embedded."""

from __future__ import annotations

import html
from pathlib import Path

from ..files import atomic_write
from .judge import FROM_PREFIX
from .text import lines, table

#: tokens per point of the plotted running mean (a single token's KL is too noisy to read)
SMOOTH = 8


def _figure(streams) -> bytes:
    """KL and top-1 disagreement along each stream (running means over `SMOOTH` tokens), events as lines."""
    import numpy as np

    from ..report.plots import plt, png

    fig, axes = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    for r in streams:
        for ax, key in zip(axes, ("kl", "disagree"), strict=True):
            values = r.series[key]
            smooth = np.convolve(values, np.ones(SMOOTH) / SMOOTH, mode="valid")
            (line,) = ax.plot(np.arange(len(smooth)) + SMOOTH - 1, smooth, label=r.label, linewidth=1.2)
            for event in r.verdict.events:
                ax.axvline(event, color=line.get_color(), linestyle=":", linewidth=1)
    axes[0].set_ylabel("top-k KL(ref ‖ deployment)")
    axes[1].set_ylabel("top-1 disagreement")
    axes[1].set_xlabel("generated token (dotted: eviction events)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return png(fig)


def write_report(result, path: Path, reproduction: list[dict] | None = None) -> Path:
    """Write the report of an `AuditResult` to `path` and return it."""
    from ..report.html import STYLE
    from ..report.markup import image_html, table_html

    streams = [r for r in (result.floor, result.deployed, result.rerun) if r is not None]
    parts = [f"<h1>kvevict audit: {html.escape(result.server.url)}</h1>",
             f'<p class="meta">{html.escape(result.server.identity.describe())}</p>',
             "<h2>Verdict</h2>", *(f'<p class="verdict">{html.escape(x)}</p>' for x in lines(result))]
    if streams:
        tol = streams[0].verdict.tolerance
        parts += [f'<p class="meta">tolerance: {html.escape(tol.describe())}; KL judged at most {tol.max_kl:g} nats '
                  "per token</p>", "<h2>Streams</h2>", table_html(table(streams), "audit-streams"),
                  "<h2>Fidelity along the stream</h2>", image_html(_figure(streams), "fidelity along the stream")]
    if reproduction:
        rows = "".join(f"<tr><td class='left'>{html.escape(r.label)}</td><td>{x['kl_audit']:.3f}</td>"
                       f"<td>{x['kl_kvevict']:.3f}</td><td>{x['disagree_audit']:.3f}</td>"
                       f"<td>{x['disagree_kvevict']:.3f}</td><td>{'yes' if x['agrees'] else 'NO'}</td></tr>"
                       for r, x in zip([r for r in streams if r is not result.floor], reproduction, strict=False))
        parts += [f"<h2>Against the reproduction ({html.escape(reproduction[0]['spec'])}, same tokens)</h2>",
                  '<table id="audit-reproduction" class="results"><thead><tr><th class="left">stream</th>'
                  "<th>KL audit</th><th>KL kvevict</th><th>top-1 miss audit</th><th>top-1 miss kvevict</th>"
                  f"<th>agree</th></tr></thead><tbody>{rows}</tbody></table>"]
    if streams:
        parts += ["<h2>Before and after each eviction event</h2>", _segments(streams)]
    if result.tasks:
        parts += ["<h2>Tasks</h2>", _task_table(result.tasks)]
    page = ("<!doctype html><html><head><meta charset='utf-8'><title>kvevict audit</title>"
            f"<style>{STYLE}</style></head><body>{''.join(parts)}</body></html>")
    return atomic_write(path, page)


def _task_table(rows) -> str:
    """One row per task: both sides' accuracy, the paired judgement, prompts the server refused or cut."""
    def cell(x, digits=2):
        return "-" if x is None else f"{x:.{digits}f}"

    body = "".join(
        f"<tr><td class='left'>{html.escape(d['task'])}</td><td>{d['n']}</td><td>{cell(d['accuracy'])}</td>"
        f"<td>{cell(d['reference'])}</td><td class='left'>{html.escape(d['judged'] or '-')}</td>"
        f"<td>{cell(d['repetition'])}</td><td>{cell(d['repetition_reference'])}</td>"
        f"<td>{len(d['refused'])}</td><td>{len(d['truncated'])}</td></tr>"
        for d in (r.as_dict() for r in rows))
    return ('<table id="audit-tasks" class="results"><thead><tr><th class="left">task</th><th>prompts</th>'
            "<th>deployment</th><th>reference</th><th class='left'>judged</th><th>repeated 4-grams</th>"
            "<th>reference's</th><th>refused</th><th>truncated</th></tr></thead>"
            f"<tbody>{body}</tbody></table>")


def _segments(streams) -> str:
    """Per stream, KL and top-1 disagreement from each event to the next (the first row: the A/A floor where the
    tokens before the first event are the floor)."""
    def cell(value, interval) -> str:
        return f"{value:.3f}" + (f" [{interval.low:.3f}, {interval.high:.3f}]" if interval else "")

    def name(r, i: int) -> str:
        if i > 0:
            return f"after event {i}"
        if not r.verdict.events:
            return "whole stream"
        return "A/A floor" if r.verdict.floor_source == FROM_PREFIX else "before event 1"

    body = "".join(
        f"<tr><td class='left'>{html.escape(r.label)}</td><td>{w.start}–{w.stop}</td>"
        f"<td class='left'>{name(r, i)}</td>"
        f"<td>{cell(w.kl, w.kl_interval)}</td><td>{cell(w.disagree, w.disagree_interval)}</td></tr>"
        for r in streams for i, w in enumerate(r.verdict.segments))
    return ('<table id="audit-segments" class="results"><thead><tr><th class="left">stream</th><th>tokens</th>'
            "<th class='left'>window</th><th>KL</th><th>top-1 disagreement</th></tr></thead>"
            f"<tbody>{body}</tbody></table>")
