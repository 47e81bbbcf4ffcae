"""The verdict at the top of an A/B report: per budget, which policy to ship and which to avoid.

A person should not have to read every table to reach the decision, and the decision
must not rest on a difference the data cannot carry. For each budget the verdict names,
from the records alone:

* the *closest* policy: lowest KL(full ‖ policy) (lowest PPL for a run without KL);
* the policies *tied* with it: those whose paired difference from it (a bootstrap over
  blocks of tokens, `uncertainty.paired_difference`) has a 95% interval that holds 0.
  A row without per-window data cannot be separated from anything, so it is tied;
* the *recommendation*: the cheapest of the tied policies that did not collapse:
  no attention statistics, then fewest pinned slots, then closest. A policy is named
  better than another only where the intervals separate;
* every policy that collapsed: the lower end of its PPL interval at least `COLLAPSE_PPL`
  times the full cache's PPL, or the upper end of its pass-key hit rate's Wilson interval
  below `COLLAPSE_NEEDLE` of the full cache's rate;
* every policy that lost token 0 (the attention sink) on some bounded (layer, KV head),
  and on how many (`eval.sink_loss`, the one definition of sink loss);
* with RULER answers in the run (`kvevict ab --ruler`, `kvevict ruler`): each policy's
  `ruler.task_scores` (its answers within the model's reach, beside the full cache's on
  the same answers), which policies the tasks cannot tell from the full cache (their
  Wilson intervals overlap) and which score below it, the tasks' collapse (the whole
  interval below `COLLAPSE_NEEDLE` of the full cache's rate), the Spearman rank
  correlation of PPL and tasks (`ruler.rank_agreement`) and the pairs the two rank in
  opposite orders, each separated by its own data. The tasks are judged on one protocol,
  `agnostic` where the run has it, and on the same answers for every policy
  (`ruler.judged`): a policy that answered fewer is named with its count, not ranked.
  The recommendation is then the cheapest policy tied on *both*; where that is not the PPL's pick, the sentence says so
  and why. A run of tasks alone (`kvevict ruler`, no PPL) gets a verdict per budget from
  the tasks alone. Tasks beyond the model (full cache below `ruler.FLOOR`) are named and
  left out.

The oracle is left out: it re-computes every token and is a reference, not a policy
one can serve with.

Closeness to the full cache is the goal only while the full cache is the better model. A
stream past the positions a model was trained on degrades the full cache itself (SmolLM2
at 20,000 tokens: full 79.1 against 21.5 for a sink-keeping window), and then the policy
nearest to it in KL is the one that degrades most alike. Where a policy's paired PPL
difference from the full cache lies wholly below 0, the verdict ranks by PPL instead and
says why (`BudgetVerdict.unsound_reference`).
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

from ..eval.sink_loss import unbounded_note
from .columns import number
from .records import PplRecord, Record, ppl_records, ruler_records, task_records
from .ruler import FLOOR, TaskScore, beyond, judged, rank_agreement
from .tables import budget_order
from .traits import is_preset, needs_attention, pinned
from .uncertainty import Blocks, Interval, blocks, mean_interval, paired_difference, wilson

#: a policy whose PPL is at least this multiple of the full cache's (its whole interval) has collapsed
COLLAPSE_PPL = 2.0
#: ... as has one whose pass-key accuracy is below this share of the full cache's (its whole interval)
COLLAPSE_NEEDLE = 0.5

#: how the verdict decides, said in the report under the verdict
HOW = (
    "How the verdict decides: policies are ranked by KL(full ‖ policy) (by PPL when the run has no KL). "
    "Every figure carries a 95% interval: a bootstrap over blocks of consecutive tokens for PPL and KL (two "
    "policies are compared paired, on the same resampled blocks), Wilson's interval for pass-key hit rates. "
    "A policy is named better than another only where the interval of their difference excludes 0; among the "
    "policies tied with the closest one, the cheapest is recommended (no attention statistics, then the fewest "
    "pinned slots). A policy collapsed when its whole PPL interval lies at or above 2× the full cache's PPL, or "
    "its whole pass-key interval below half of the full cache's rate. With RULER answers, each policy's task rate "
    "is pooled over the answers of one protocol (agnostic where the run has it: aware flatters the policies told "
    "the question; the other protocols stay in the tables) and of every task and length within the model's reach (a "
    f"task on which the full cache scores below {FLOOR:.0%} is beyond this model at that length: named, left out), "
    "on the same answers for every policy and the full cache (a policy that answered fewer is named with its count, "
    "not ranked); a policy scores below the full cache only where their Wilson intervals are disjoint, and "
    "collapsed on the tasks when its whole interval lies below half of the full cache's rate. The recommendation is "
    "the cheapest policy tied with the closest on PPL and not below the full cache on the tasks; where the tasks "
    "overturn the perplexity's pick, the sentence says so. A run of tasks alone is judged on the tasks alone. "
    "Where a policy's PPL is lower than the full cache's beyond the noise (a stream past the model's trained "
    "positions degrades the full cache itself), closeness to the full cache is no virtue: the policies are then "
    "ranked by PPL, and the sentence says so."
)


@dataclass(frozen=True)
class Needle:
    """Pass-key trials of one policy at one budget."""

    hits: float
    trials: int

    @property
    def rate(self) -> float:
        return self.hits / self.trials

    @property
    def interval(self) -> Interval | None:
        return wilson(self.hits, self.trials)


@dataclass(frozen=True)
class Candidate:
    """One policy at one budget, with the facts the verdict uses."""

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

    @property
    def rank(self) -> tuple[float, float]:
        """Closest to the full cache first: by KL, then PPL (by PPL alone where `by_ppl`); a row of tasks alone
        (no PPL) by its task rate."""
        if math.isnan(self.ppl):
            return (math.inf, -self.task.rate if self.task else math.inf)
        if self.by_ppl:
            return (self.ppl, self.ppl)
        return (math.inf if self.kl is None else self.kl, self.ppl)

    @cached_property  # a bootstrap: drawn once, read by the collapse test and every sentence
    def ppl_interval(self) -> Interval | None:
        return None if self.nll_blocks is None else mean_interval(self.nll_blocks, exp=True)

    @cached_property
    def kl_interval(self) -> Interval | None:
        return None if self.kl_blocks is None else mean_interval(self.kl_blocks)

    @property
    def cost(self) -> tuple[bool, int]:
        """What serving it costs beyond a window: attention statistics first (they rule out a fused attention
        kernel and cost a pass per step), then pinned slots (a few entries of memory)."""
        return (self.reads_attention, self.pins)


@dataclass
class BudgetVerdict:
    """The verdict at one budget: every `candidate` (closest first), the ones `tied` with the closest,
    the `recommended` one, `collapsed` as (candidate, reason), `lost_sink`, and the sentence.

    With tasks: `task_tied` (not told from the full cache on the tasks), `task_below` (below it), `ppl_pick`
    (what PPL alone recommends), `agreement` (`ruler.rank_agreement` rows of this budget), `opposed` ((a, b):
    PPL separates a ahead of b, the tasks b ahead of a) and `beyond` (task@length the model fails itself).
    A budget of tasks alone is its label (`50%`), with `full_ppl` None and no PPL."""

    budget: int | str
    full_ppl: float | None
    candidates: list[Candidate]
    collapsed: list[tuple[Candidate, str]] = field(default_factory=list)
    lost_sink: list[Candidate] = field(default_factory=list)
    tied: list[Candidate] = field(default_factory=list)
    recommended: Candidate | None = None
    sentence: str = ""
    task_tied: list[Candidate] = field(default_factory=list)
    task_below: list[Candidate] = field(default_factory=list)
    ppl_pick: Candidate | None = None
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
    """Pass-key trials per (policy as written, budget as written: `64` or `full`)."""
    hits: dict[tuple[str, str], list[float]] = {}
    for trial in task_records(records, "needle"):
        f = trial.fields
        hits.setdefault((str(f["policy"]), str(f["budget"])), []).append(float(f["hit"]))
    return {key: Needle(sum(values), len(values)) for key, values in hits.items()}


def needle_means(records: Sequence[Record]) -> dict[tuple[str, str], float]:
    """Mean pass-key hit rate per (policy as written, budget as written)."""
    return {key: n.rate for key, n in needle_trials(records).items()}


def _candidates(records: list[PplRecord], budget: int, needle: dict[tuple[str, str], Needle],
                tasks: dict[tuple[str, str], TaskScore]) -> list[Candidate]:
    """The policy rows at `budget` (a sink-sweep row that repeats a policy row counts once)."""
    seen: dict[str, Candidate] = {}
    for r in records:
        if r.budget != budget or r.kind not in ("policy", "sinks") or r.policy in seen:
            continue
        sink = r.sink()
        seen[r.policy] = Candidate(
            r.name, r.ppl, r.kl_to_full, needle.get((r.name, str(budget))),
            sink.lost if sink else 0, sink.bounded if sink else 0,
            pinned(r.policy), needs_attention(r.policy), blocks(r.curve, "ppl"), blocks(r.kl_curve, "kl"),
            unbounded_note(sink, r.sliding_window), tasks.get((r.name, str(budget))), preset=is_preset(r.policy),
        )
    return list(seen.values())


def _task_candidates(budget: str, tasks: dict[tuple[str, str], TaskScore]) -> list[Candidate]:
    """The policies answered at a budget that has no PPL rows (a `kvevict ruler` run): tasks alone."""
    return [Candidate(policy, math.nan, None, None, 0, 0, pinned(policy), needs_attention(policy), task=score)
            for (policy, label), score in tasks.items() if label == budget]


def _collapse(c: Candidate, full_ppl: float | None, full_needle: Needle | None) -> str | None:
    """Why `c` collapsed (its whole interval beyond the line), or None."""
    if full_ppl:
        low = c.ppl_interval.low if c.ppl_interval else c.ppl
        if low >= COLLAPSE_PPL * full_ppl * (1 - 1e-9):  # exp(log(x)) may round x down in its last bit
            return f"PPL {c.ppl / full_ppl:.1f}× full"
    if c.needle is not None and full_needle is not None and full_needle.rate:
        high = c.needle.interval.high if c.needle.interval else c.needle.rate
        if high < COLLAPSE_NEEDLE * full_needle.rate:
            return f"pass-key {c.needle.rate:.0%} vs full {full_needle.rate:.0%}"
    if c.task is not None and c.task.full_rate and c.task.interval.high < COLLAPSE_NEEDLE * c.task.full_rate:
        return f"tasks {c.task.rate:.0%} vs full {c.task.full_rate:.0%}"
    return None


def _task_ahead(a: Candidate, b: Candidate) -> bool:
    """The tasks separate a ahead of b: a's whole Wilson interval above b's (the rule `below_full` applies)."""
    return a.task is not None and b.task is not None and a.task.interval.low > b.task.interval.high


def _ppl_ahead(a: Candidate, b: Candidate, by_kl: bool) -> bool:
    """PPL (KL) separates a ahead of b: a ranks closer, and their paired difference excludes 0."""
    return a.rank < b.rank and not _tied(a, b, by_kl)


def _tied(best: Candidate, other: Candidate, by_kl: bool) -> bool:
    """True unless the paired interval of (other - best) excludes 0, on KL's blocks when both rows have them
    (ranked by KL), else on NLL's (older records carry no per-window KL); no blocks at all: cannot be separated."""
    a, b = (other.kl_blocks, best.kl_blocks) if by_kl else (None, None)
    if a is None or b is None:
        a, b = other.nll_blocks, best.nll_blocks
    if a is None or b is None:
        return True
    found = paired_difference(a, b)
    return found is None or found.contains(0.0)


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
    return pins + (", attention statistics" if c.reads_attention else ", no attention statistics")


def _task_scores(c: Candidate) -> str:
    return f"tasks {c.task.text()} vs full {c.task.full_text()}"


def _task_clause(v: BudgetVerdict) -> str:
    """What the tasks say of the recommendation beside PPL's pick: agreement, or the disagreement, named."""
    best, pick = v.recommended, v.ppl_pick
    if not v.has_tasks or not v.has_ppl:
        return ""
    if best is pick:
        if best.task is None:
            return "; the run holds no task answers for it"
        # "not told apart" is all the data can say: on few answers a large gap is still inside the noise
        return f"; the tasks do not tell it apart from the full cache ({_task_scores(best)})"
    why = ("it scores below the full cache on the tasks" if pick.task is not None and pick.task.below_full
           else "it collapsed on the tasks")
    return (f"; PPL and the tasks point at different policies: PPL alone would pick {pick.name}, but {why} "
            f"({_task_scores(pick)}), while {best.name} is tied on both ({_task_scores(best)})")


def _sentence(v: BudgetVerdict) -> str:
    """The recommendation: the cheapest policy tied with the closest that did not collapse (and, with tasks, not
    below the full cache on them); if it lost token 0 somewhere, the closest one that kept it everywhere beside
    it (or the advice to pin sinks)."""
    if v.closest is None:
        if v.partial:
            return (f"At budget {v.budget} no policy answered every {v.protocol} answer the budget asks "
                    f"({', '.join(f'{p} {k}/{n}' for p, k, n in v.partial)}): run the same tasks and samples for each.")
        if v.beyond:
            return (f"At budget {v.budget} every task the run holds is beyond this model at its length (the full "
                    f"cache scores below {FLOOR:.0%}: {', '.join(v.beyond)}): the tasks cannot judge the policies.")
        return f"At budget {v.budget} the run holds no policy rows: nothing to recommend."
    bad = {c.name for c, _ in v.collapsed}
    if v.recommended is None and v.ppl_pick is not None:  # PPL names a policy, the tasks refuse every such one
        pick = v.ppl_pick
        tasks = _names(v.task_tied)
        text = (f"At budget {v.budget} PPL and the tasks point at different policies: PPL alone would ship "
                f"{pick.name} ({_scores(pick)}), but it scores below the full cache on the tasks "
                f"({_task_scores(pick)}), and so does every policy PPL cannot tell from it; "
                + (f"the tasks cannot tell {tasks} from the full cache, though PPL separates them from "
                   f"{pick.name}" if tasks else "no policy holds the full cache's task accuracy: raise the budget"))
        return text + (f"; avoid {', '.join(sorted(bad))} (collapsed)." if bad else ".")
    below = [c for c in v.task_below if c.name not in bad]
    if v.recommended is None:
        if not v.has_ppl and below:
            return (f"At budget {v.budget} every policy scored below the full cache on the tasks "
                    f"({_names(below)}): raise the budget before shipping any of them"
                    + (f"; avoid {', '.join(sorted(bad))} (collapsed)." if bad else "."))
        return (f"At budget {v.budget} every policy collapsed ({_names([c for c, _ in v.collapsed])}): "
                "raise the budget before shipping any of them.")
    best = v.recommended
    if not v.has_ppl:  # tasks alone
        text = f"At budget {v.budget} ship {best.name} ({_task_scores(best)})"
        others = [c for c in v.tied if c is not best]
        if others:
            text += (f"; the tasks cannot tell it or {_names(others)} from the full cache, "
                     f"and it is the cheapest ({_cost_text(best)})")
        else:
            text += f"; the only policy the tasks cannot tell from the full cache ({_cost_text(best)})"
        if below:
            text += f"; below the full cache on the tasks: {_names(below)}"
        return text + (f"; avoid {', '.join(sorted(bad))} (collapsed)." if bad else ".")
    full = f" vs {v.full_ppl:.2f} full" if v.full_ppl else ""
    text = f"At budget {v.budget} ship {best.name} ({_scores(best)}{full})"
    if v.unsound_reference:
        text += f"; {v.unsound_reference}"
    others = [c for c in v.tied if c is not best and c.name not in {b.name for b in below}]
    if others:
        text += (f"; not told apart from it by the data: {_names(others)}, "
                 f"and it is the cheapest ({_cost_text(best)})")
    text += _task_clause(v)
    if best.heads_lost:
        text += f", but it lost token 0 on {best.heads_lost} of {best.heads} heads"
        safe = [c for c in v.candidates if c.name not in bad]
        keeper = next((c for c in safe if not c.heads_lost), None)
        if keeper is None and best.preset:
            text += ": keep sinks with the engine's own option (the preset's keep or sink count, e.g. 4)"
        elif keeper is None:
            text += f": pin sinks (sinkN+{best.name})"
        else:
            text += f"; the closest policy that kept it on every head is {keeper.name} ({_scores(keeper)})"
    if bad:
        text += f"; avoid {', '.join(sorted(bad))} (collapsed)"
    return text + "."


def _judge(v: BudgetVerdict, full_needle: Needle | None) -> None:
    """Fill `v` from its candidates: collapse, ties (PPL's and the tasks'), the recommendation, the sentence."""
    for c in v.candidates:
        reason = _collapse(c, v.full_ppl, full_needle)
        if reason:
            v.collapsed.append((c, reason))
        if c.heads_lost:
            v.lost_sink.append(c)
    bad = {c.name for c, _ in v.collapsed}
    safe = [c for c in v.candidates if c.name not in bad]
    v.task_below = [c for c in v.candidates if c.task is not None and c.task.below_full]
    v.task_tied = [c for c in safe if c.task is not None and not c.task.below_full]
    if not safe:
        return
    if not v.has_ppl:  # tasks alone: tied means not told from the full cache
        v.tied = list(v.task_tied)
        v.recommended = min(v.tied, key=lambda c: (c.cost, c.rank)) if v.tied else None
        return
    by_kl = all(c.kl is not None for c in safe) and v.unsound_reference is None
    v.tied = [c for c in safe if c is safe[0] or _tied(safe[0], c, by_kl)]
    v.ppl_pick = min(v.tied, key=lambda c: (c.cost, c.rank))
    below = {c.name for c in v.task_below}
    both = [c for c in v.tied if c.name not in below]
    v.recommended = min(both, key=lambda c: (c.cost, c.rank)) if both else None
    # the tasks' test first: it is a comparison of two intervals, PPL's a paired bootstrap
    v.opposed = [(a, b) for a in v.candidates for b in v.candidates
                 if _task_ahead(b, a) and _ppl_ahead(a, b, by_kl)]


def verdict(records: Sequence[Record]) -> list[BudgetVerdict]:
    """One `BudgetVerdict` per budget of the run, smallest budget first (budgets of tasks alone after those of
    PPL, by their label: shares, then entries, largest first)."""
    rows = ppl_records(records)
    full = next((r for r in rows if r.kind == "full"), None)
    full_ppl = full.ppl if full else None
    needle = needle_trials(records)
    full_needle = needle.get(("full", "full"))
    answers = ruler_records(records)
    found = judged(answers)
    tasks = found.scores
    agreement = rank_agreement(rows, answers)
    out_of_reach = sorted(f"{task}@{length} ({shape})" for shape, task, length in beyond(answers))
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
                          sorted(candidates, key=lambda c: c.rank), unsound_reference=reason)
        if answers:
            v.agreement = [a for a in agreement if a["budget"] == str(budget)]
            v.beyond = out_of_reach
            v.protocol = found.protocol
            v.partial = [(policy, *counts) for (policy, label), counts in found.partial.items()
                         if label == str(budget)]
        _judge(v, full_needle)
        v.sentence = _sentence(v)
        out.append(v)
    return out


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
    """The budget's facts under its sentence: the rankings', then the policies left out of the tasks' ranking."""
    return _ranking_facts(v) + ([_partial_fact(v)] if v.partial else [])


def _ranking_facts(v: BudgetVerdict) -> list[tuple[str, str]]:
    collapsed = "; ".join(f"{c.name} ({why})" for c, why in v.collapsed) or "none"
    lost = "; ".join(f"{c.name} on {c.heads_lost} of {c.heads} heads" for c in v.lost_sink) or "none"
    if not v.has_ppl:  # tasks alone: the closest by task rate, the collapsed, then the tasks' facts
        return [("closest to full", _closest_text(v)), ("collapsed", collapsed)] + _task_facts(v)
    first = "lowest PPL (the full cache is worse)" if v.unsound_reference else "closest to full"
    facts = [(first, _closest_text(v)),
             ("tied with it (paired 95% block bootstrap)", _names(v.tied[1:]) or "none"),
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
              "; ".join(f"{c.name} {c.task.text()}" for c in found) + f"; full {full} (on the same answers)"),
             ("not told apart from the full cache on the tasks", _names(v.task_tied) or "none"),
             ("below the full cache on the tasks", _names(v.task_below) or "none")]
    if v.agreement:
        rho = "; ".join(f"{a['protocol']}: " + ("n/a (no spread)" if a["rho"] is None else f"{a['rho']:+.2f}")
                        + f" over {len(a['policies'])} policies" for a in v.agreement)
        opposed = "; ".join(f"PPL ranks {a.name} ahead of {b.name}, the tasks {b.name} ahead of {a.name}"
                            for a, b in v.opposed)
        facts.append(("PPL vs task ranking (Spearman ρ)", rho + (f"; they disagree: {opposed}" if opposed else
                                                                   "; no pair is ranked in opposite orders "
                                                                   "by both measures' data")))
    if v.beyond:
        facts.append((f"beyond this model at this length (full cache below {FLOOR:.0%}; left out)",
                      ", ".join(v.beyond)))
    return facts


def markdown(verdicts: Sequence[BudgetVerdict], title: str = "Verdict") -> str:
    """The verdict as Markdown under `## title`: one bullet list per budget, the sentence first."""
    lines = [f"## {title}", ""]
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
    """The verdict as HTML: per budget the sentence in bold, then the facts; how it decides at the end."""
    parts = []
    for v in verdicts:
        items = "".join(f"<li>{html.escape(label)}: {html.escape(text)}</li>" for label, text in _facts(v))
        parts.append(f'<div class="verdict" data-budget="{v.budget}"><p><strong>{html.escape(v.sentence)}'
                     f"</strong></p><ul>{items}</ul></div>")
    parts.append(f'<p class="how">{html.escape(HOW)}</p>')
    return "".join(parts)
