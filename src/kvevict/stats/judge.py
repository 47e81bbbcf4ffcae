"""`judge`: a candidate against its reference on every metric the tolerance bounds, the one rule behind every
decision the project ships by.

The A/B verdict (each policy against the full cache, and policies against each other for
ties), the PPL envelope's probes and the task envelope's cells all call it, so a policy judged
inside in one view is judged inside in every other. Per metric the judgement is the tolerance
rule's paired interval (`tolerance`): the PPL ratio over the same blocks of tokens, KL(reference
‖ candidate) where the tolerance bounds it, and accuracy on the same prompts per kind of answer
(RULER tasks, pass-key trials). The candidate is inside only where every metric due is judged
and inside; outside where any metric is outside; undecided otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .tolerance import Judgement, Outcome, Tolerance, judge_kl, judge_pair, judge_ppl
from .uncertainty import Blocks


@dataclass(frozen=True)
class Measured:
    """What one side measured, paired with the other side's. `nll`: the blocks of its stream's NLL (`[n]` block
    means and weights, `uncertainty.Blocks`); `kl`: the blocks of its KL to the reference (a candidate's);
    `answers`: per kind of answer ("tasks", "pass-key") its scores in [0, 1], position i of both sides one prompt.
    `stream`: measured on a stream, so its PPL (and its KL where the tolerance bounds KL) is due even where no
    blocks were recorded: missing then, never silently skipped."""

    nll: Blocks | None = None
    kl: Blocks | None = None
    answers: Mapping[str, Sequence[float]] = field(default_factory=dict)
    stream: bool = False


@dataclass(frozen=True)
class Judged:
    """A candidate's `judgements` ((metric label, Judgement), in the order judged) and the metrics due that it
    holds no paired data for (`missing`)."""

    judgements: tuple[tuple[str, Judgement], ...]
    missing: tuple[str, ...] = ()

    @property
    def outcome(self) -> Outcome:
        """Outside if any metric is; inside if every metric due is judged and inside; else undecided."""
        found = [j.outcome for _, j in self.judgements]
        if "outside" in found:
            return "outside"
        return "inside" if found and not self.missing and set(found) == {"inside"} else "undecided"

    @property
    def deciding(self) -> Judgement | None:
        """The judgement that decided the outcome: the first outside, else the first undecided, else the first."""
        for outcome in ("outside", "undecided"):
            hit = next((j for _, j in self.judgements if j.outcome == outcome), None)
            if hit is not None:
                return hit
        return self.judgements[0][1] if self.judgements else None


def judge(candidate: Measured, reference: Measured, tolerance: Tolerance, due: Sequence[str] = ()) -> Judged:
    """`candidate` against `reference` on every metric both hold paired: the PPL ratio (where the candidate has
    NLL blocks or is a stream), KL (where the tolerance bounds it and the candidate has KL blocks or is a stream),
    then each kind of answer both sides gave, in the candidate's order. `due`: kinds of answer the candidate must
    hold (missing where it does not)."""
    found: list[tuple[str, Judgement]] = []
    missing: list[str] = []

    def add(label: str, judgement: Judgement | None, required: bool) -> None:
        if judgement is not None:
            found.append((label, judgement))
        elif required:
            missing.append(label)

    if candidate.stream or candidate.nll is not None:
        add("PPL", judge_ppl(candidate.nll, reference.nll, tolerance), candidate.stream)
    if tolerance.max_kl is not None and (candidate.stream or candidate.kl is not None):
        add("KL", judge_kl(candidate.kl, tolerance), candidate.stream)
    for label, scores in candidate.answers.items():
        if label in reference.answers:
            found.append((label, judge_pair(scores, reference.answers[label], tolerance)))
    missing += [label for label in due if label not in candidate.answers]
    return Judged(tuple(found), tuple(missing))
