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
says why (`BudgetVerdict.unsound_reference`).
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

from ..eval.sink_loss import unbounded_note
from ..records.schema import PplRecord, Record, ppl_records, ruler_records, task_records
from ..stats.judge import Judged, Measured, judge
from ..stats.tolerance import Judgement, Tolerance
from ..stats.uncertainty import Blocks, Interval, blocks, mean_interval, paired_difference, wilson
from .columns import number
from .kv_bytes import mib
from .ruler import FLOOR, TaskScore, beyond, judged, rank_agreement, where_label
from .tables import budget_order
from .traits import is_preset, kv_bits, needs_attention, pinned

#: outside and collapsed: the whole paired PPL ratio interval at or above this
COLLAPSE_PPL = 2.0
#: ... or the whole accuracy interval below this share of the full cache's rate
COLLAPSE_NEEDLE = 0.5

#: how the verdict decides, said in the report under the verdict
HOW = (
    "How the verdict decides: each policy is compared with the full cache on the same data, with a paired 95% "
    "interval per metric: the PPL ratio by a bootstrap over blocks of tokens (scipy.stats.bootstrap), task and "
    "pass-key accuracy by Bonett and Price's adjusted Wald interval of the paired difference (JEBS 2012), or "
    "with a minimum accuracy ratio by Bonett and Price's paired interval of the ratio (Stat Med 2006). "
    "Inside: the whole interval within the stated tolerance; outside: the whole interval past it (collapsed: "
    "past 2× the full cache's PPL or below half its accuracy); undecided otherwise, with the samples that would "
    "decide it. Ship: the cheapest policy inside on every metric (fewest KV bytes where the budget's rows differ "
    "in storage width, then no attention statistics, then fewest pinned slots); "
    "tied: inside the tolerance of each other both ways. Tasks are judged on one protocol (agnostic "
    f"first), on the answers every policy gave, within the model's reach (full cache ≥ {FLOOR:.0%}). Where the full "
    "cache itself is worse beyond the noise, policies are ranked by PPL."
)


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

    def judged_text(self) -> str:
        return "; ".join(f"{label}: {j.text()}" for label, j in self.judgements) or "no paired data"


@dataclass
class BudgetVerdict:
    """The verdict at one budget: every `candidate` (closest first), split by outcome into `inside`, `undecided`
    and `outside` (each closest first), `collapsed` as (candidate, reason), the `recommended` one, `tied` with it,
    `lost_sink`, and the sentence. With tasks: `agreement` (`ruler.rank_agreement` rows of this budget),
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
    sentence: str = ""
    agreement: list[dict] = field(default_factory=list)
    opposed: list[tuple[Candidate, Candidate]] = field(default_factory=list)
    beyond: list[str] = field(default_factory=list)
    protocol: str | None = None  # the protocol the tasks are judged on (`ruler.judged_protocol`)
    partial: list[tuple[str, int, int]] = field(default_factory=list)  # (policy, answered, asked): not ranked
    unsound_reference: str | None = None  # why the policies are ranked by PPL, not by KL to the full cache

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
    widths = len({kv_bits(r.policy) for r in here}) > 1  # bytes, not entries, tell the rows' memory apart
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
        pool = [c for c in v.inside if c is v.inside[0] or not v.unsound_reference or _tied(c, v.inside[0], tol)]
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
        reason = _unsound_reference(full, candidates) if isinstance(budget, int) else None
        if reason:
            candidates = [replace(c, by_ppl=True) for c in candidates]
        v = BudgetVerdict(budget, full_ppl if isinstance(budget, int) else None,
                          sorted(candidates, key=lambda c: c.rank), tol, unsound_reference=reason)
        if answers:
            v.agreement = [a for a in agreement if a["budget"] == str(budget)]
            v.beyond = out_of_reach
            v.protocol = found.protocol
            v.partial = [(policy, *counts) for (policy, label), counts in found.partial.items()
                         if label == str(budget)]
        _judge(v, full_blocks)
        v.sentence = _sentence(v)
        out.append(v)
    return out


def _unsound_reference(full: PplRecord | None, candidates: Sequence[Candidate]) -> str | None:
    """Why the full cache cannot be the reference the policies are ranked by closeness to, or None: some policy's
    paired PPL difference from it (NLL over the same resampled blocks) lies wholly below 0."""
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
    shown = mean_interval(reference, exp=True)
    who = "every policy" if len(better) == len(candidates) else _names(sorted(better, key=lambda c: c.ppl))
    return (f"ranked by PPL, not by closeness to the full cache, which is worse than {who} here "
            f"(PPL {full.ppl:.2f}" + (f" {shown.text()}" if shown else "") + ": a stream past the positions the "
            "model was trained on degrades the full cache itself)")


def _names(candidates: Sequence[Candidate]) -> str:
    return ", ".join(c.name for c in candidates)


def _scores(c: Candidate) -> str:
    kl = "" if c.kl is None else f"KL {c.kl:.3f}" + (f" {c.kl_interval.text(3)}" if c.kl_interval else "") + ", "
    return kl + f"PPL {c.ppl:.2f}" + (f" {c.ppl_interval.text()}" if c.ppl_interval else "")


def _cost_text(c: Candidate) -> str:
    pins = "no pinned slots" if not c.pins else f"{c.pins} pinned slot{'s' if c.pins > 1 else ''}"
    held = "" if c.kv_bf16 is None else f"{mib(c.kv_bf16)} MiB KV per sequence at bf16, "
    return held + pins + (", attention statistics" if c.reads_attention else ", no attention statistics")


def _task_scores(c: Candidate) -> str:
    return f"tasks {c.task.text()} vs full {c.task.full_text()}"


def _more_text(c: Candidate) -> str:
    """What would decide an undecided policy: per straddling metric, the samples an estimate asks for."""
    parts = []
    for label, j in c.judgements:
        if j.outcome != "undecided":
            continue
        if j.reason is not None:
            parts.append(f"its {label} ratio is undefined ({j.reason})")
        elif j.more_samples is None:
            parts.append(f"no number of samples decides its {label} (the estimate sits on the limit)")
        elif j.metric == "ppl-ratio" and c.nll_blocks is not None:
            tokens = j.more_samples * float(c.nll_blocks.weights.mean())
            parts.append(f"about {j.more_samples} more blocks of tokens ({tokens:,.0f} tokens) would decide its PPL")
        else:
            unit = {"tasks": "task answers", "pass-key": "pass-key trials"}.get(label, "blocks of tokens")
            parts.append(f"about {j.more_samples} more {unit} would decide its {label}")
    parts += [f"it has no paired {m} data to judge" for m in c.missing]
    return "; ".join(parts)


def _avoid_text(v: BudgetVerdict, skip: Candidate | None = None) -> str:
    bad = dict((c.name, why) for c, why in v.collapsed)
    named = [f"{c.name} (collapsed)" if c.name in bad else c.name for c in v.outside if c is not skip]
    return f"; avoid {', '.join(named)} (outside the tolerance)" if named else ""


def _sentence(v: BudgetVerdict) -> str:
    """Ship the recommendation; else the closest undecided policy and what would decide it; else the closest
    policy, shown outside. Then what to avoid, and token 0's fate for the one shipped."""
    if v.closest is None:
        if v.partial:
            return (f"At budget {v.budget} no policy answered every {v.protocol} answer the budget asks "
                    f"({', '.join(f'{p} {k}/{n}' for p, k, n in v.partial)}): run the same tasks and samples for each.")
        if v.beyond:
            return (f"At budget {v.budget} every task the run holds is beyond this model at its length (the full "
                    f"cache scores below {FLOOR:.0%}: {', '.join(v.beyond)}): the tasks cannot judge the policies.")
        return f"At budget {v.budget} the run holds no policy rows: nothing to recommend."
    best = v.recommended
    if best is None:
        if v.undecided:
            c = v.undecided[0]
            text = (f"At budget {v.budget} nothing is shown inside the tolerance yet; undecided: {c.name} "
                    f"({c.judged_text()}): {_more_text(c)}")
            others = v.undecided[1:]
            if others:
                text += f"; also undecided: {_names(others)}"
        else:
            c = v.closest
            text = (f"At budget {v.budget} nothing is shown inside the tolerance; closest is {c.name} "
                    f"({c.judged_text()}): raise the budget")
        return text + _avoid_text(v, skip=v.closest if not v.undecided else None) + "."
    full = f" vs {v.full_ppl:.2f} full" if v.full_ppl and not math.isnan(best.ppl) else ""
    scores = _scores(best) + full + "; " if not math.isnan(best.ppl) else ""
    text = f"At budget {v.budget} ship {best.name} ({scores}{best.judged_text()}): inside the tolerance"
    if v.unsound_reference:
        text += f"; {v.unsound_reference}"
    others = [c for c in v.inside if c is not best]
    if others:
        text += f"; also inside: {_names(others)}, and it is the cheapest ({_cost_text(best)})"
    if best.heads_lost:
        text += f", but it lost token 0 on {best.heads_lost} of {best.heads} heads"
        keeper = next((c for c in v.inside if not c.heads_lost), None)
        if keeper is None and best.preset:
            text += ": keep sinks with the engine's own option (the preset's keep or sink count, e.g. 4)"
        elif keeper is None:
            text += f": pin sinks (sinkN+{best.name})"
        else:
            text += f"; the closest policy inside the tolerance that kept it on every head is {keeper.name}"
    return text + _avoid_text(v) + "."


def _closest_text(v: BudgetVerdict) -> str:
    c = v.closest
    if c is None:
        return "-"
    if math.isnan(c.ppl):
        return f"{c.name} ({_task_scores(c)})"
    kl = "" if c.kl is None else f"KL {number(c.kl, 3)}, "
    return f"{c.name} ({kl}PPL {c.ppl:.2f})"


def _needle_text(v: BudgetVerdict) -> str | None:
    found = [c for c in v.candidates if c.needle is not None]
    if not found:
        return None
    parts = []
    for c in found:
        interval = c.needle.interval
        parts.append(f"{c.name} {c.needle.hits:g}/{c.needle.trials}" + (f" {interval.text()}" if interval else ""))
    return "; ".join(parts)

def _facts(v: BudgetVerdict) -> list[tuple[str, str]]:
    """The budget's facts under its sentence: the judgements, the rankings', then the policies left out."""
    return _ranking_facts(v) + ([_partial_fact(v)] if v.partial else [])


def _judgement_facts(v: BudgetVerdict) -> list[tuple[str, str]]:
    facts = []
    for outcome, found in (("inside", v.inside), ("undecided", v.undecided), ("outside", v.outside)):
        if found:
            facts.append((f"{outcome} the tolerance (paired 95% intervals)" if outcome != "undecided"
                          else "undecided (paired 95% intervals straddle a limit)",
                          "; ".join(f"{c.name}: {c.judged_text()}" for c in found)))
    return facts


def _ranking_facts(v: BudgetVerdict) -> list[tuple[str, str]]:
    collapsed = "; ".join(f"{c.name} ({why})" for c, why in v.collapsed) or "none"
    lost = "; ".join(f"{c.name} on {c.heads_lost} of {c.heads} heads" for c in v.lost_sink) or "none"
    tied = _names(v.tied) or "none"
    if not v.has_ppl:  # tasks alone: the closest by task rate, the judgements, then the tasks' facts
        return ([("closest to full", _closest_text(v))] + _judgement_facts(v)
                + [("tied with the one shipped (inside the tolerance both ways)", tied),
                   ("collapsed", collapsed)] + _task_facts(v))
    first = "lowest PPL (the full cache is worse)" if v.unsound_reference else "closest to full"
    facts = [(first, _closest_text(v))] + _judgement_facts(v)
    facts += [("tied with the one shipped (inside the tolerance both ways)", tied),
              ("collapsed", collapsed), ("lost token 0", lost)]
    note = next((c.layers_note for c in v.candidates if c.layers_note), None)
    if note:
        facts.append(("not counted", note))
    needle = _needle_text(v)
    if needle:
        facts.append(("pass-key hits (95% Wilson interval)", needle))
    if v.has_tasks:
        facts += _task_facts(v)
    return facts


def _partial_fact(v: BudgetVerdict) -> tuple[str, str]:
    """The policies left out of the tasks' ranking: fewer answers than the others at the budget, with their counts."""
    return (f"not ranked on the tasks (fewer {v.protocol} answers than the other policies at this budget; a run of "
            "the same tasks and samples fills them)",
            "; ".join(f"{name} {answered}/{asked}" for name, answered, asked in v.partial))


def _task_facts(v: BudgetVerdict) -> list[tuple[str, str]]:
    found = [c for c in v.candidates if c.task is not None]
    full = found[0].task.full_text() if found else "-"
    facts = [(f"RULER answers within reach ({v.protocol}; hits/answers, 95% Wilson interval)",
              "; ".join(f"{c.name} {c.task.text()}" for c in found) + f"; full {full} (on the same answers)")]
    if v.agreement:
        rho = "; ".join(f"{a['protocol']}: " + ("n/a (no spread)" if a["rho"] is None else f"{a['rho']:+.2f}")
                        + f" over {len(a['policies'])} policies" for a in v.agreement)
        opposed = "; ".join(f"PPL ranks {a.name} ahead of {b.name}, the tasks {b.name} ahead of {a.name}"
                            for a, b in v.opposed)
        facts.append(("PPL vs task ranking (Spearman ρ)", rho + (f"; they disagree: {opposed}" if opposed else
                                                                   "; no pair is shown in opposite orders "
                                                                   "beyond the tolerance by both measures")))
    if v.beyond:
        facts.append((f"beyond this model at this length (full cache below {FLOOR:.0%}; left out)",
                      ", ".join(v.beyond)))
    return facts


def markdown(verdicts: Sequence[BudgetVerdict], title: str = "Verdict") -> str:
    """The verdict as Markdown under `## title`: the tolerance, then one bullet list per budget, the sentence first."""
    lines = [f"## {title}", ""]
    if verdicts:
        lines += [f"Tolerance: {verdicts[0].tolerance.describe()}.", ""]
    for v in verdicts:
        lines.append(f"**Budget {v.budget}.** {v.sentence}")
        lines.append("")
        for label, text in _facts(v):
            lines.append(f"- {label}: {text}")
        lines.append("")
    if verdicts:
        lines.append(HOW)
    return "\n".join(lines).rstrip()


def section_html(verdicts: Sequence[BudgetVerdict]) -> str:
    """The verdict as HTML: the tolerance, per budget the sentence in bold, then the facts; how it decides at the
    end."""
    parts = []
    if verdicts:
        parts.append(f'<p class="tolerance">Tolerance: {html.escape(verdicts[0].tolerance.describe())}.</p>')
    for v in verdicts:
        items = "".join(f"<li>{html.escape(label)}: {html.escape(text)}</li>" for label, text in _facts(v))
        parts.append(f'<div class="verdict" data-budget="{v.budget}"><p><strong>{html.escape(v.sentence)}'
                     f"</strong></p><ul>{items}</ul></div>")
    parts.append(f'<p class="how">{html.escape(HOW)}</p>')
    return "".join(parts)
