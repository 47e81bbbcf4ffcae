"""The verdict at the top of an A/B report: per budget, which policy the data show safe to ship, and which to avoid.

A person should not have to read every table to reach the decision, and the decision must
not rest on a difference the data cannot carry. Safe means *shown* inside a tolerance the
user states (`tolerance.Tolerance`: by default PPL within 5% of the full cache's, task
accuracy within 5 points), never "not told apart from the full cache": with a few samples
almost nothing can be told apart. Every policy is judged against the full cache on the same
data (`stats.judge.judge`: paired intervals) on every metric
the run holds: PPL, KL where `max_kl` is stated, RULER task answers, pass-key trials. Per
budget the verdict names, from the records alone:

* *ship*: the cheapest policy inside the tolerance on every metric (fewest KV bytes where the
  budget's rows differ in storage width, then no attention statistics,
  then fewest pinned slots, then closest to the full cache);
* *undecided*, where none is inside and some straddle a limit: the closest of those, and
  about how many more samples would decide it;
* *nothing shown inside*, where every policy is outside: the closest one, with its interval;
* *avoid*: every policy outside the tolerance, *collapsed* where its whole interval lies
  beyond 2× the full cache's PPL or below half of its accuracy (the same intervals);
* *tied*: policies whose paired intervals against each other lie inside the tolerance both ways;
* the policies that lost token 0 (`eval.sink_loss`), the PPL vs task rank correlation
  (`ruler.rank_agreement`) and the pairs the two measures order oppositely (each beyond the
  tolerance), tasks beyond the model (`ruler.beyond`) and policies answered on fewer prompts.

The oracle is left out: it re-computes every token and is a reference, not a policy one
can serve with. Closeness to the full cache is the ranking's goal only while the full cache
is the better model: where a policy's paired PPL lies wholly below the full cache's (a
stream past the model's trained positions), the policies are ranked by PPL and the sentence
says why (`BudgetVerdict.unsound`).

This module decides and says nothing: how each decision is said (the sentence, the facts under
it, the verdict as Markdown and HTML) is `verdict_text`'s, which reads these dataclasses and
decides nothing. The records flow one way, so a wording never reaches back into a decision.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

from ..eval.sink_loss import unbounded_note
from ..records.schema import PplRecord, Record, ppl_records, ruler_records, task_records
from ..stats.judge import Judged, Measured, judge
from ..stats.tolerance import Judgement, Tolerance
from ..stats.uncertainty import Blocks, Interval, blocks, mean_interval, paired_difference, wilson
from .ruler import TaskScore, beyond, judged, rank_agreement, where_label
from .tables import budget_order
from .traits import is_preset, kv_width, needs_attention, pinned

#: outside and collapsed: the whole paired PPL ratio interval at or above this
COLLAPSE_PPL = 2.0
#: ... or the whole accuracy interval below this share of the full cache's rate
COLLAPSE_NEEDLE = 0.5

@dataclass(frozen=True)
class Needle:
    """Pass-key trials of one policy at one budget; `pairs`: (its hit, the full cache's) on the same trials."""

    hits: float
    trials: int
    pairs: tuple[tuple[float, float], ...] = ()

    @property
    def rate(self) -> float:
        return self.hits / self.trials

    @property
    def interval(self) -> Interval | None:
        return wilson(self.hits, self.trials)


@dataclass(frozen=True)
class Candidate:
    """One policy at one budget, with the facts the verdict uses and its `judgements` (metric label, Judgement)."""

    name: str
    ppl: float
    kl: float | None
    needle: Needle | None  # pass-key trials at this budget (None: no needle test)
    heads_lost: int  # bounded (layer, KV head) pairs that evicted token 0 at some point
    heads: int  # bounded (layer, KV head) pairs in the model
    pins: int = 0  # leading tokens the policy always keeps
    reads_attention: bool = False  # needs attention statistics (costs a second pass on some paths)
    nll_blocks: Blocks | None = None
    kl_blocks: Blocks | None = None
    layers_note: str | None = None  # what happened in the layers the budget does not bound (sliding windows)
    task: TaskScore | None = None  # RULER answers within reach at this budget (None: no tasks)
    by_ppl: bool = False  # ranked by PPL, not KL: the full cache is no sound reference (module docstring)
    preset: bool = False  # a serving engine's rule: its sinks are its engine's option, not a sinkN+ wrapper
    judgements: tuple[tuple[str, Judgement], ...] = ()
    missing: tuple[str, ...] = ()  # metrics the run states but this row cannot be judged on (no per-block data)
    #: KV bytes per sequence at bf16, set where rows of the budget differ in storage width (`q4+...`): there the
    #: entries are no measure of memory (None: every row holds its entries at one width, bytes follow the budget)
    kv_bf16: int | None = None

    @property
    def rank(self) -> tuple[float, float]:
        """Closest to the full cache first: by KL, then PPL (by PPL alone where `by_ppl`); a row of tasks alone
        (no PPL) by its task rate."""
        if math.isnan(self.ppl):
            return (math.inf, -self.task.rate if self.task else math.inf)
        if self.by_ppl:
            return (self.ppl, self.ppl)
        return (math.inf if self.kl is None else self.kl, self.ppl)

    @cached_property  # a bootstrap: drawn once, read by every sentence
    def ppl_interval(self) -> Interval | None:
        return None if self.nll_blocks is None else mean_interval(self.nll_blocks, exp=True)

    @cached_property
    def kl_interval(self) -> Interval | None:
        return None if self.kl_blocks is None else mean_interval(self.kl_blocks)

    @property
    def cost(self) -> tuple[int, bool, int]:
        """What serving it costs beyond a window: KV bytes first where rows of the budget differ in width (a
        `q8+full` row holds more than a plain one at the budget), then attention statistics (they rule out a fused
        attention kernel and cost a pass per step), then pinned slots (a few entries of memory)."""
        return (self.kv_bf16 or 0, self.reads_attention, self.pins)

    @property
    def outcome(self) -> str:
        """Outside if any metric is; inside if every stated metric is judged and inside; else undecided
        (`stats.judge.Judged.outcome`)."""
        return Judged(self.judgements, self.missing).outcome


@dataclass(frozen=True)
class Unsound:
    """The full cache is no sound reference at a budget: the policies whose paired PPL lies wholly below its own
    (`better`, lowest PPL first; `every`: all of the budget's), its PPL and that PPL's interval."""

    better: tuple[str, ...]
    every: bool
    full_ppl: float
    interval: Interval | None


@dataclass
class BudgetVerdict:
    """The verdict at one budget: every `candidate` (closest first), split by outcome into `inside`, `undecided`
    and `outside` (each closest first), `collapsed` as (candidate, reason), the `recommended` one, `tied` with it,
    `lost_sink`. With tasks: `agreement` (`ruler.rank_agreement` rows of this budget),
    `opposed` ((a, b): PPL shows a ahead of b beyond the tolerance, the tasks b ahead of a) and `beyond`
    (task@length the model fails itself). A budget of tasks alone is its label (`50%`), with no PPL."""

    budget: int | str
    full_ppl: float | None
    candidates: list[Candidate]
    tolerance: Tolerance = field(default_factory=Tolerance)
    inside: list[Candidate] = field(default_factory=list)
    undecided: list[Candidate] = field(default_factory=list)
    outside: list[Candidate] = field(default_factory=list)
    collapsed: list[tuple[Candidate, str]] = field(default_factory=list)
    lost_sink: list[Candidate] = field(default_factory=list)
    tied: list[Candidate] = field(default_factory=list)
    recommended: Candidate | None = None
    agreement: list[dict] = field(default_factory=list)
    opposed: list[tuple[Candidate, Candidate]] = field(default_factory=list)
    beyond: list[str] = field(default_factory=list)
    protocol: str | None = None  # the protocol the tasks are judged on (`ruler.judged_protocol`)
    partial: list[tuple[str, int, int]] = field(default_factory=list)  # (policy, answered, asked): not ranked
    unsound: Unsound | None = None  # why the policies are ranked by PPL, not by KL to the full cache

    @property
    def has_ppl(self) -> bool:
        return any(not math.isnan(c.ppl) for c in self.candidates)

    @property
    def has_tasks(self) -> bool:
        return any(c.task is not None for c in self.candidates)

    @property
    def closest(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None


def needle_trials(records: Sequence[Record]) -> dict[tuple[str, str], Needle]:
    """Pass-key trials per (policy as written, budget as written: `64` or `full`), each paired with the full
    cache's trial of the same length, depth and seed where the run holds it."""
    hits: dict[tuple[str, str], dict[tuple, float]] = {}
    for trial in task_records(records, "needle"):
        f = trial.fields
        where = (f.get("length"), f.get("depth"), f.get("trial"), trial.key if f.get("trial") is None else None)
        hits.setdefault((str(f["policy"]), str(f["budget"])), {})[where] = float(f["hit"])
    full = hits.get(("full", "full"), {})
    return {key: Needle(sum(found.values()), len(found),
                        tuple((h, full[w]) for w, h in sorted(found.items(), key=lambda x: str(x[0])) if w in full))
            for key, found in hits.items()}


def needle_means(records: Sequence[Record]) -> dict[tuple[str, str], float]:
    """Mean pass-key hit rate per (policy as written, budget as written)."""
    return {key: n.rate for key, n in needle_trials(records).items()}


def _candidates(records: list[PplRecord], budget: int, needle: dict[tuple[str, str], Needle],
                tasks: dict[tuple[str, str], TaskScore]) -> list[Candidate]:
    """The policy rows at `budget` (a sink-sweep row that repeats a policy row counts once)."""
    seen: dict[str, Candidate] = {}
    here = [r for r in records if r.budget == budget and r.kind in ("policy", "sinks")]
    widths = len({kv_width(r.policy) for r in here}) > 1  # bytes, not entries, tell the rows' memory apart
    for r in here:
        if r.policy in seen:
            continue
        sink = r.sink()
        seen[r.policy] = Candidate(
            r.name, r.ppl, r.kl_to_full, needle.get((r.name, str(budget))),
            sink.lost if sink else 0, sink.bounded if sink else 0,
            pinned(r.policy), needs_attention(r.policy), blocks(r.curve, "ppl"), blocks(r.kl_curve, "kl"),
            unbounded_note(sink, r.sliding_window), tasks.get((r.name, str(budget))), preset=is_preset(r.policy),
            kv_bf16=r.kv_bytes_bf16 if widths else None,
        )
    return list(seen.values())


def _task_candidates(budget: str, tasks: dict[tuple[str, str], TaskScore]) -> list[Candidate]:
    """The policies answered at a budget that has no PPL rows (a `kvevict ruler` run): tasks alone."""
    return [Candidate(policy, math.nan, None, None, 0, 0, pinned(policy), needs_attention(policy), task=score)
            for (policy, label), score in tasks.items() if label == budget]


def _judged(c: Candidate, full: Blocks | None, tasks_stated: bool, tol: Tolerance) -> Candidate:
    """`c` with its judgements against the full cache on every metric the run states, and the ones it lacks."""
    answers: dict[str, list[float]] = {}
    reference: dict[str, list[float]] = {}
    if c.task is not None:
        answers["tasks"], reference["tasks"] = c.task.scores, c.task.full_scores
    if c.needle is not None and c.needle.pairs:
        answers["pass-key"], reference["pass-key"] = [p for p, _ in c.needle.pairs], [f for _, f in c.needle.pairs]
    found = judge(Measured(c.nll_blocks, c.kl_blocks, answers, stream=not math.isnan(c.ppl)),
                  Measured(full, answers=reference), tol, due=("tasks",) if tasks_stated else ())
    return replace(c, judgements=found.judgements, missing=found.missing)


def _collapse(c: Candidate) -> str | None:
    """Why `c` collapsed (a judgement's whole interval past the collapse line), or None."""
    for label, j in c.judgements:
        if j.metric == "ppl-ratio" and j.low >= COLLAPSE_PPL * (1 - 1e-9):
            return f"PPL ratio [{j.low:.2f}, {j.high:.2f}] ≥ {COLLAPSE_PPL:g}"
        full_rate = (c.task.full_rate if label == "tasks" else
                     sum(f for _, f in c.needle.pairs) / len(c.needle.pairs) if label == "pass-key" else 0)
        if j.metric == "accuracy-drop" and full_rate and j.low > (1 - COLLAPSE_NEEDLE) * full_rate:
            return f"{label} below half of the full cache's {full_rate:.0%} (drop [{j.low:.2f}, {j.high:.2f}])"
        if j.metric == "accuracy-ratio" and j.reason is None and j.low > 1 - COLLAPSE_NEEDLE:
            return f"{label} below half of the full cache's (ratio [{1 - j.high:.2f}, {1 - j.low:.2f}])"
    return None


def _pair_outcome(a: Candidate, b: Candidate, tol: Tolerance) -> list[tuple[str, Judgement]]:
    """a against b (how much a loses to b) on every metric both hold paired: PPL ratio a / b, task answers."""
    answers_a: dict[str, list[float]] = {}
    answers_b: dict[str, list[float]] = {}
    if a.task is not None and b.task is not None:
        ua, ub = a.task.by_unit(), b.task.by_unit()
        both = sorted(set(ua) & set(ub), key=lambda u: tuple(map(str, u)))
        if both:
            answers_a["tasks"], answers_b["tasks"] = [ua[u] for u in both], [ub[u] for u in both]
    return list(judge(Measured(a.nll_blocks, answers=answers_a), Measured(b.nll_blocks, answers=answers_b),
                      tol).judgements)


def _tied(a: Candidate, b: Candidate, tol: Tolerance) -> bool:
    """Inside the tolerance of each other both ways on every metric both hold."""
    found = _pair_outcome(a, b, tol) + _pair_outcome(b, a, tol)
    return bool(found) and all(j.outcome == "inside" for _, j in found)


def _opposed(a: Candidate, b: Candidate, tol: Tolerance) -> bool:
    """PPL shows b worse than a beyond the tolerance, the tasks show a worse than b beyond it."""
    ppl = dict(_pair_outcome(b, a, tol)).get("PPL")
    tasks = dict(_pair_outcome(a, b, tol)).get("tasks")
    return ppl is not None and tasks is not None and ppl.outcome == tasks.outcome == "outside"


def _judge(v: BudgetVerdict, full: Blocks | None) -> None:
    """Fill `v` from its candidates: judgements, outcome lists, collapse, the recommendation, ties, opposed pairs."""
    tol = v.tolerance
    v.candidates = [_judged(c, full, v.has_tasks, tol) for c in v.candidates]
    for c in v.candidates:
        {"inside": v.inside, "undecided": v.undecided, "outside": v.outside}[c.outcome].append(c)
        reason = _collapse(c) if c.outcome == "outside" else None
        if reason:
            v.collapsed.append((c, reason))
        if c.heads_lost:
            v.lost_sink.append(c)
    if v.inside:
        # past a degraded full cache every policy may be inside: then only those within the tolerance of the best
        pool = [c for c in v.inside if c is v.inside[0] or v.unsound is None or _tied(c, v.inside[0], tol)]
        v.recommended = min(pool, key=lambda c: (c.cost, c.rank))
        v.tied = [c for c in v.candidates if c is not v.recommended and _tied(c, v.recommended, tol)]
    if v.has_ppl and v.has_tasks:
        v.opposed = [(a, b) for a in v.candidates for b in v.candidates if a is not b and _opposed(a, b, tol)]


def verdict(records: Sequence[Record], tolerance: Tolerance | None = None) -> list[BudgetVerdict]:
    """One `BudgetVerdict` per budget of the run, smallest budget first (budgets of tasks alone after those of
    PPL, by their label: shares, then entries, largest first), judged against `tolerance` (default: `Tolerance()`)."""
    tol = tolerance or Tolerance()
    rows = ppl_records(records)
    full = next((r for r in rows if r.kind == "full"), None)
    full_ppl = full.ppl if full else None
    full_blocks = blocks(full.curve, "ppl") if full else None
    needle = needle_trials(records)
    answers = ruler_records(records)
    found = judged(answers)
    tasks = found.scores
    agreement = rank_agreement(rows, answers)
    out_of_reach = sorted(f"{where_label(task, length)} ({shape})" for shape, task, length in beyond(answers))
    out = []
    ppl_budgets = sorted({r.budget for r in rows if r.budget is not None and r.kind != "oracle"})
    task_only = sorted({r.budget for r in answers if r.budget != "full" and r.shape == found.protocol}
                       - {str(b) for b in ppl_budgets},
                       key=budget_order)
    for budget in [*ppl_budgets, *task_only]:
        candidates = (_candidates(rows, budget, needle, tasks) if isinstance(budget, int)
                      else _task_candidates(budget, tasks))
        unsound = _unsound(full, candidates) if isinstance(budget, int) else None
        if unsound is not None:
            candidates = [replace(c, by_ppl=True) for c in candidates]
        v = BudgetVerdict(budget, full_ppl if isinstance(budget, int) else None,
                          sorted(candidates, key=lambda c: c.rank), tol, unsound=unsound)
        if answers:
            v.agreement = [a for a in agreement if a["budget"] == str(budget)]
            v.beyond = out_of_reach
            v.protocol = found.protocol
            v.partial = [(policy, *counts) for (policy, label), counts in found.partial.items()
                         if label == str(budget)]
        _judge(v, full_blocks)
        out.append(v)
    return out


def _unsound(full: PplRecord | None, candidates: Sequence[Candidate]) -> Unsound | None:
    """Whether the full cache cannot be the reference the policies are ranked by closeness to: some policy's paired
    PPL difference from it (NLL over the same resampled blocks) lies wholly below 0. None where it can."""
    reference = blocks(full.curve, "ppl") if full is not None else None
    if reference is None:
        return None
    better = []
    for c in candidates:
        found = paired_difference(c.nll_blocks, reference) if c.nll_blocks is not None else None
        if found is not None and found.high < 0:
            better.append(c)
    if not better:
        return None
    return Unsound(tuple(c.name for c in sorted(better, key=lambda c: c.ppl)), len(better) == len(candidates),
                   full.ppl, mean_interval(reference, exp=True))
