"""The audit's verdict in words and its table: what a team reads first, on the terminal and atop the report."""

from __future__ import annotations

from ..report.columns import Column, Table
from .judge import Window
from .kv_capacity import buys_line
from .stream import StreamResult


def _window(w: Window | None, key: str) -> str:
    if w is None:
        return "-"
    interval = w.kl_interval if key == "kl" else w.disagree_interval
    value = w.kl if key == "kl" else w.disagree
    return f"{value:.3f}" + (f" [{interval.low:.3f}, {interval.high:.3f}]" if interval else "")


#: one row per stream: where it evicts, the A/A floor against the judged window, the verdict
STREAMS: list[Column[StreamResult]] = [
    Column("stream", lambda r: r.label, align="left"),
    Column("kept", lambda r: str(r.plan.keep) if r.plan.rule == "context-shift" else "-"),
    Column("events", lambda r: ", ".join(map(str, r.verdict.events[:4])) + (" …" if len(r.verdict.events) > 4 else "")
           or "none"),
    Column("judged", lambda r: "whole" if r.verdict.judge == "whole" else "from 1st event"),
    Column("floor KL", lambda r: _window(r.verdict.floor, "kl")),
    Column("window KL", lambda r: _window(r.verdict.after, "kl")),
    Column("floor top-1 miss", lambda r: _window(r.verdict.floor, "disagree")),
    Column("window top-1 miss", lambda r: _window(r.verdict.after, "disagree")),
    Column("verdict", lambda r: r.verdict.outcome, align="left"),
]


def table(results: list[StreamResult]) -> Table:
    return Table.of(STREAMS, results)


def stream_line(r: StreamResult) -> str:
    """`as deployed: outside (KL 0.41 [0.35, 0.48] > 0.049; ...); sink-loss signature at token 224`."""
    v = r.verdict
    judged = "; ".join(j.text() + ("" if label == "KL" else f" ({label})") for label, j in v.judgements)
    line = f"{r.label}: {v.outcome} ({judged})"
    if v.signature:
        line += f"; sink-loss signature: KL and top-1 disagreement step up at the first eviction (generated token " \
                f"{v.events[0]}) beyond the A/A floor"
    elif v.step and v.judge == "after-event":
        line += f"; a step at the first eviction (token {v.events[0]}) beyond the floor, within the KL limit"
    if v.judge == "whole":
        line += "; the whole stream judged" + _against_floor(v)
    return line + _evictions(r)


def _against_floor(v) -> str:
    """The whole stream against the twin's A/A floor, or the absence of one said plainly."""
    if v.floor is None:
        return ": no A/A floor, as no twin was given (--floor-url) and every token may carry the loss"
    if v.above_floor:
        return ": its KL lies above the twin's A/A floor, a loss with no eviction point"
    return ": its KL is not told apart from the twin's A/A floor"


def _evictions(r: StreamResult) -> str:
    """What the server's own account says of eviction where the audit placed no event."""
    if r.verdict.events:
        return ""
    if r.plan.rule == "none" and r.generation.truncated is not True:
        return "; this server never evicted: it declares no eviction, none was placed, and it never said it truncated"
    if r.generation.truncated:
        return "; the server says it truncated, but no event could be placed: give --context N where its KV limit lies"
    return "; no eviction event inside the stream"


def floor_line(r: StreamResult) -> str:
    """`A/A floor (the twin): KL 0.000 [0.000, 0.000], top-1 disagreement 0.000 against the reference; inside`."""
    w = r.verdict.after
    return (f"{r.label}: KL {_window(w, 'kl')}, top-1 disagreement {_window(w, 'disagree')} against the reference "
            f"over its whole stream; {r.verdict.outcome} by itself")


EFFECT = {
    "gone": "keeping the sinks removes the step: set n_keep (llama-server --keep {n}) in the deployment",
    "smaller": "keeping the sinks shrinks the step beyond the noise: n_keep {n} helps, eviction still costs",
    "unchanged": "keeping the sinks does not change the step: the loss is not the sinks'",
    "no-step": "no step at the first eviction for kept sinks to remove: no rerun with them, and no advice on them",
}


def lines(result) -> list[str]:
    """The verdict sentences of an `AuditResult`: the server audited first, then the streams, the tasks, the notes."""
    out = [f"server: {result.server.identity.describe()} at {result.server.url}"]
    out += [floor_line(r) for r in (result.floor,) if r is not None]
    out += [] if result.deployed is None else [stream_line(result.deployed)]
    if result.deployed is not None and result.buys is not None:
        judged = dict(result.deployed.verdict.judgements).get("KL")
        kl = judged.estimate if judged is not None else float(result.deployed.series["kl"].mean())
        out.append(buys_line(result.buys, kl, result.deployed.verdict.outcome))
    if result.rerun is not None:
        out.append(stream_line(result.rerun))
    if result.effect is not None:
        out.append(EFFECT[result.effect].format(n=result.rerun.plan.n_keep if result.rerun else None))
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
