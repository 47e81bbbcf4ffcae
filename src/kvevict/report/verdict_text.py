"""The verdict in words: per budget the sentence, its facts, and the verdict as Markdown and as HTML.

Everything here reads the decisions `verdict` made (`BudgetVerdict`, `Candidate`, `Unsound`)
and decides nothing: which policy ships, which are undecided, outside, collapsed or tied is
`verdict.py`'s; how that is said is this module's. The decisions never import it: a caller that
prints a verdict asks for its words here (`sentence(v)`).
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

from .columns import number
from .kv_bytes import mib
from .ruler import FLOOR
from .verdict import BudgetVerdict, Candidate, Unsound

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


def judged_text(c: Candidate) -> str:
    """A candidate's judgements, `PPL: PPL ratio 1.02 [0.99, 1.04] ≤ 1.05; tasks: ...`."""
    return "; ".join(f"{label}: {j.text()}" for label, j in c.judgements) or "no paired data"


def unsound_text(u: Unsound) -> str:
    """Why a budget's policies are ranked by PPL: the full cache is worse than some of them beyond the noise."""
    who = "every policy" if u.every else ", ".join(u.better)
    return (f"ranked by PPL, not by closeness to the full cache, which is worse than {who} here "
            f"(PPL {u.full_ppl:.2f}" + (f" {u.interval.text()}" if u.interval else "") + ": a stream past the "
            "positions the model was trained on degrades the full cache itself)")


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


def sentence(v: BudgetVerdict) -> str:
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
                    f"({judged_text(c)}): {_more_text(c)}")
            others = v.undecided[1:]
            if others:
                text += f"; also undecided: {_names(others)}"
        else:
            c = v.closest
            text = (f"At budget {v.budget} nothing is shown inside the tolerance; closest is {c.name} "
                    f"({judged_text(c)}): raise the budget")
        return text + _avoid_text(v, skip=v.closest if not v.undecided else None) + "."
    full = f" vs {v.full_ppl:.2f} full" if v.full_ppl and not math.isnan(best.ppl) else ""
    scores = _scores(best) + full + "; " if not math.isnan(best.ppl) else ""
    text = f"At budget {v.budget} ship {best.name} ({scores}{judged_text(best)}): inside the tolerance"
    if v.unsound is not None:
        text += f"; {unsound_text(v.unsound)}"
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
                          "; ".join(f"{c.name}: {judged_text(c)}" for c in found)))
    return facts


def _ranking_facts(v: BudgetVerdict) -> list[tuple[str, str]]:
    collapsed = "; ".join(f"{c.name} ({why})" for c, why in v.collapsed) or "none"
    lost = "; ".join(f"{c.name} on {c.heads_lost} of {c.heads} heads" for c in v.lost_sink) or "none"
    tied = _names(v.tied) or "none"
    if not v.has_ppl:  # tasks alone: the closest by task rate, the judgements, then the tasks' facts
        return ([("closest to full", _closest_text(v))] + _judgement_facts(v)
                + [("tied with the one shipped (inside the tolerance both ways)", tied),
                   ("collapsed", collapsed)] + _task_facts(v))
    first = "lowest PPL (the full cache is worse)" if v.unsound is not None else "closest to full"
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
        lines.append(f"**Budget {v.budget}.** {sentence(v)}")
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
        parts.append(f'<div class="verdict" data-budget="{v.budget}"><p><strong>{html.escape(sentence(v))}'
                     f"</strong></p><ul>{items}</ul></div>")
    parts.append(f'<p class="how">{html.escape(HOW)}</p>')
    return "".join(parts)
