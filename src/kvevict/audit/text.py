"""The audit's verdict in words and its table: what a team reads first, on the terminal and atop the report."""

from __future__ import annotations

from ..report.columns import Column, Table
from .judge import Window
from .stream import StreamResult


def _window(w: Window | None, key: str) -> str:
    if w is None:
        return "-"
    interval = w.kl_interval if key == "kl" else w.disagree_interval
    value = w.kl if key == "kl" else w.disagree
    return f"{value:.3f}" + (f" [{interval.low:.3f}, {interval.high:.3f}]" if interval else "")


#: one row per stream: where it evicts, the A/A floor against the first event's window, the verdict
STREAMS: list[Column[StreamResult]] = [
    Column("stream", lambda r: r.label, align="left"),
    Column("kept", lambda r: str(r.plan.keep)),
    Column("events", lambda r: ", ".join(map(str, r.verdict.events[:4])) + (" …" if len(r.verdict.events) > 4 else "")
           or "none"),
    Column("floor KL", lambda r: _window(r.verdict.floor, "kl")),
    Column("1st-event KL", lambda r: _window(r.verdict.after, "kl")),
    Column("floor top-1 miss", lambda r: _window(r.verdict.floor, "disagree")),
    Column("1st-event top-1 miss", lambda r: _window(r.verdict.after, "disagree")),
    Column("verdict", lambda r: r.verdict.outcome, align="left"),
]


def table(results: list[StreamResult]) -> Table:
    return Table.of(STREAMS, results)


def stream_line(r: StreamResult) -> str:
    """`as deployed: outside (KL 0.41 [0.35, 0.48] > 0.100; ...); sink-loss signature at token 224`."""
    judged = "; ".join(j.text() + ("" if label == "KL" else f" ({label})") for label, j in r.verdict.judgements)
    line = f"{r.label}: {r.verdict.outcome} ({judged})"
    if r.verdict.signature:
        line += f"; sink-loss signature: KL and top-1 disagreement step up at the first eviction (generated token " \
                f"{r.verdict.events[0]}) beyond the A/A floor"
    elif r.verdict.step:
        line += f"; a step at the first eviction (token {r.verdict.events[0]}) beyond the floor, within the KL limit"
    elif not r.verdict.events:
        line += "; no eviction event inside the stream"
    return line


EFFECT = {
    "gone": "keeping the sinks removes the step: set n_keep (llama-server --keep {n}) in the deployment",
    "smaller": "keeping the sinks shrinks the step beyond the noise: n_keep {n} helps, eviction still costs",
    "unchanged": "keeping the sinks does not change the step: the loss is not the sinks'",
}


def lines(result) -> list[str]:
    """The verdict sentences of an `AuditResult`."""
    out = [] if result.deployed is None else [stream_line(result.deployed)]
    if result.rerun is not None:
        out.append(stream_line(result.rerun))
        out.append(EFFECT[result.effect].format(n=result.rerun.plan.n_keep))
    for row in result.tasks:
        out.append(task_line(row))
    return out + [f"note: {n}" for n in result.notes]


def task_line(row) -> str:
    """`niah_single_1: inside (accuracy drop +0.00 [-0.09, 0.09] ≤ 0.05), 0.90 against the reference's 0.90`."""
    found = row.as_dict()
    if not row.scores:
        what = "refused" if row.refused else "cut" if row.truncated else "could not score"
        return f"{row.task}: the deployment {what} every prompt: it does not evict a prompt beyond its context"
    line = (f"{row.task}: {found['outcome']} ({found['judged']}), {found['accuracy']:.2f} against the reference's "
            f"{found['reference']:.2f} on {found['n']} prompts")
    if row.repetition:
        line += f"; repeated 4-grams {found['repetition']:.2f} against {found['repetition_reference']:.2f}"
    if row.refused or row.truncated:
        line += f"; refused {len(row.refused)}, truncated {len(row.truncated)} prompts beyond its context"
    return line
