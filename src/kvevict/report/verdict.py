"""The verdict at the top of an A/B report: per budget, which policy to ship and which to avoid.

A person should not have to read every table to reach the decision. For each budget the
verdict names, from the records alone:

* the policy closest to the full cache (lowest KL(full ‖ policy), PPL beside it; a run
  without KL is ranked by PPL);
* every policy that collapsed: PPL at least `COLLAPSE_PPL` times the full cache's, or a
  mean pass-key accuracy below `COLLAPSE_NEEDLE` of the full cache's at that budget;
* every policy that lost token 0 (the attention sink) on some (layer, KV head), and on
  how many;
* one sentence of recommendation built from those facts.

The oracle is left out: it re-computes every token and is a reference, not a policy
one can serve with.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from .columns import number
from .records import PplRecord, Record, ppl_records, task_records

#: a policy whose PPL is at least this multiple of the full cache's has collapsed
COLLAPSE_PPL = 2.0
#: ... as has one whose pass-key accuracy is below this share of the full cache's
COLLAPSE_NEEDLE = 0.5


@dataclass(frozen=True)
class Candidate:
    """One policy at one budget, with the facts the verdict uses."""

    name: str
    ppl: float
    kl: float | None
    needle: float | None  # mean pass-key accuracy at this budget (None: no needle test)
    heads_lost: int  # (layer, KV head) pairs that evicted token 0 at some point
    heads: int  # (layer, KV head) pairs in the model

    @property
    def rank(self) -> tuple[float, float]:
        return (math.inf if self.kl is None else self.kl, self.ppl)


@dataclass
class BudgetVerdict:
    """The verdict at one budget: every `candidate`, the `closest` (None without policy
    rows), `collapsed` as (candidate, reason), `lost_sink`, and the recommendation sentence."""

    budget: int
    full_ppl: float | None
    candidates: list[Candidate]
    collapsed: list[tuple[Candidate, str]] = field(default_factory=list)
    lost_sink: list[Candidate] = field(default_factory=list)
    sentence: str = ""

    @property
    def closest(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None


def sink_heads(record: PplRecord) -> tuple[int, int]:
    """(pairs that lost token 0, all pairs) from `sink_lost_at` `[layers][kv_heads]` (-1: never)."""
    grid = record.sink_lost_at or []
    cells = [value for layer in grid for value in layer]
    return sum(1 for value in cells if value >= 0), len(cells)


def needle_means(records: Sequence[Record]) -> dict[tuple[str, str], float]:
    """Mean pass-key hit rate per (policy as written, budget as written: `64` or `full`)."""
    hits: dict[tuple[str, str], list[float]] = {}
    for trial in task_records(records, "needle"):
        f = trial.fields
        hits.setdefault((str(f["policy"]), str(f["budget"])), []).append(float(f["hit"]))
    return {key: sum(values) / len(values) for key, values in hits.items()}


def _candidates(records: list[PplRecord], budget: int, needle: dict[tuple[str, str], float]) -> list[Candidate]:
    """The policy rows at `budget` (a sink-sweep row that repeats a policy row counts once)."""
    seen: dict[str, Candidate] = {}
    for r in records:
        if r.budget != budget or r.kind not in ("policy", "sinks") or r.policy in seen:
            continue
        lost, heads = sink_heads(r)
        seen[r.policy] = Candidate(r.name, r.ppl, r.kl_to_full, needle.get((r.name, str(budget))), lost, heads)
    return list(seen.values())


def _collapse(c: Candidate, full_ppl: float | None, full_needle: float | None) -> str | None:
    """Why `c` collapsed, or None."""
    if full_ppl and c.ppl >= COLLAPSE_PPL * full_ppl:
        return f"PPL {c.ppl / full_ppl:.1f}× full"
    if c.needle is not None and full_needle and c.needle < COLLAPSE_NEEDLE * full_needle:
        return f"pass-key {c.needle:.0%} vs full {full_needle:.0%}"
    return None


def _names(candidates: Sequence[Candidate]) -> str:
    return ", ".join(c.name for c in candidates)


def _scores(c: Candidate) -> str:
    return ("" if c.kl is None else f"KL {c.kl:.3f}, ") + f"PPL {c.ppl:.2f}"


def _sentence(v: BudgetVerdict) -> str:
    """The recommendation: the closest policy that did not collapse; if it lost token 0 somewhere, the closest
    one that kept it everywhere beside it (or the advice to pin sinks); else why nothing can be shipped."""
    if v.closest is None:
        return f"At budget {v.budget} the run holds no policy rows: nothing to recommend."
    bad = {c.name for c, _ in v.collapsed}
    safe = [c for c in v.candidates if c.name not in bad]
    if not safe:
        return (f"At budget {v.budget} every policy collapsed ({_names([c for c, _ in v.collapsed])}): "
                "raise the budget before shipping any of them.")
    best = safe[0]
    full = f" vs {v.full_ppl:.2f} full" if v.full_ppl else ""
    text = f"At budget {v.budget} ship {best.name} ({_scores(best)}{full})"
    if best.heads_lost:
        text += f", but it lost token 0 on {best.heads_lost} of {best.heads} heads"
        keeper = next((c for c in safe if not c.heads_lost), None)
        if keeper is None:
            text += f": pin sinks (sinkN+{best.name})"
        else:
            text += f"; the closest policy that kept it on every head is {keeper.name} ({_scores(keeper)})"
    if bad:
        text += f"; avoid {', '.join(sorted(bad))} (collapsed)"
    return text + "."


def verdict(records: Sequence[Record]) -> list[BudgetVerdict]:
    """One `BudgetVerdict` per budget of the run, smallest budget first."""
    rows = ppl_records(records)
    full = next((r for r in rows if r.kind == "full"), None)
    full_ppl = full.ppl if full else None
    needle = needle_means(records)
    out = []
    for budget in sorted({r.budget for r in rows if r.budget is not None}):
        candidates = _candidates(rows, budget, needle)
        full_needle = needle.get(("full", "full"))
        v = BudgetVerdict(budget, full_ppl, sorted(candidates, key=lambda c: c.rank))
        for c in v.candidates:
            reason = _collapse(c, full_ppl, full_needle)
            if reason:
                v.collapsed.append((c, reason))
            if c.heads_lost:
                v.lost_sink.append(c)
        v.sentence = _sentence(v)
        out.append(v)
    return out


def _closest_text(v: BudgetVerdict) -> str:
    c = v.closest
    if c is None:
        return "-"
    return f"{c.name} (KL {number(c.kl, 3)}, PPL {c.ppl:.2f})"


def markdown(verdicts: Sequence[BudgetVerdict], title: str = "Verdict") -> str:
    """The verdict as Markdown under `## title`: one bullet list per budget, the sentence first."""
    lines = [f"## {title}", ""]
    for v in verdicts:
        lines.append(f"**Budget {v.budget}.** {v.sentence}")
        lines.append("")
        for label, text in _facts(v):
            lines.append(f"- {label}: {text}")
        lines.append("")
    return "\n".join(lines).rstrip()


def _facts(v: BudgetVerdict) -> list[tuple[str, str]]:
    collapsed = "; ".join(f"{c.name} ({why})" for c, why in v.collapsed) or "none"
    lost = "; ".join(f"{c.name} on {c.heads_lost} of {c.heads} heads" for c in v.lost_sink) or "none"
    return [("closest to full", _closest_text(v)), ("collapsed", collapsed), ("lost token 0", lost)]


def section_html(verdicts: Sequence[BudgetVerdict]) -> str:
    """The verdict as HTML: per budget the sentence in bold, then the three facts."""
    parts = []
    for v in verdicts:
        items = "".join(f"<li>{html.escape(label)}: {html.escape(text)}</li>" for label, text in _facts(v))
        parts.append(f'<div class="verdict" data-budget="{v.budget}"><p><strong>{html.escape(v.sentence)}'
                     f"</strong></p><ul>{items}</ul></div>")
    return "".join(parts)
