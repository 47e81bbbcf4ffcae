"""RULER results from the records: accuracy per cell with its binomial interval, and what is out of reach.

A cell is one protocol, task, length, policy and budget; its accuracy is the mean
score over its answers (samples, and questions under `multi`), with the 95% Wilson
interval. Where the full cache itself scores below `FLOOR` at a task and length, the
task is "beyond this model at this length": its cells are shown, marked, and left out
of every ranking, since a policy cannot lose what the model never had.

`task_scores` is the one task figure the verdict and the rank correlation read: per
policy and budget, its answers pooled over every task and length within reach, on the
very answers the full cache gave too, beside the full cache's hits on them; each rate
with its Wilson interval (`uncertainty.wilson`, the report's one binomial interval).

`judged` is what the verdict reads of it. One protocol only (`judged_protocol`):
`agnostic` where the run has it, since a policy's rate under `aware` is flattered by the
question it was told, and a policy `aware` refuses (window) would otherwise be ranked
on other answers than one it accepts. And the same answers for every policy: a policy
that answered fewer of them than the budget asks (added later, or killed part-way) is
set aside with its count, not ranked on a different set.

`rank_agreement` answers the first question a user asks of the tasks: does the
perplexity ranking of the policies say the same as the task ranking? Per protocol and
budget, Spearman's rank correlation between streaming PPL (lower is better) and the
`task_scores` rate (higher is better), over the policies both hold.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from scipy import stats

from ..records.schema import OWN_LENGTHS, PplRecord, RulerRecord
from ..stats.uncertainty import Interval, wilson
from .columns import Table
from .kv_bytes import mib
from .tables import budget_order

#: below this full-cache accuracy a task is beyond the model at that length
FLOOR = 0.5


@dataclass
class RulerCell:
    protocol: str  # agnostic | aware | stream | multi-requests | multi-turns
    task: str
    length: int
    policy: str
    budget: str
    n: int
    accuracy: float
    low: float
    high: float
    beyond: bool = False
    #: KV bytes per sequence once the context was compressed, at bf16, the mean over the cell's answers (None where
    #: a record holds no byte figure: written before it)
    kv_bytes_bf16: float | None = None

    @property
    def where(self) -> str:
        return where_label(self.task, self.length)


def where_label(task: str, length: int) -> str:
    """`task@length`; a QA file's pooled lines (`RulerRecord.cell_length`) carry no single length."""
    return f"{task} at each line's length" if length == OWN_LENGTHS else f"{task}@{length}"


def beyond(records: Iterable[RulerRecord], floor: float = FLOOR) -> set[tuple[str, str, int]]:
    """(protocol, task, length) where the full cache's mean score is below `floor`: beyond this model there."""
    full: dict[tuple[str, str, int], list[float]] = {}
    for r in records:
        if r.budget == "full":
            full.setdefault((r.shape, r.task, r.cell_length), []).append(float(r.score))
    return {where for where, scores in full.items() if sum(scores) / len(scores) < floor}


def cells(records: Iterable[RulerRecord], floor: float = FLOOR) -> list[RulerCell]:
    records = list(records)
    groups: dict[tuple, list[float]] = {}
    held: dict[tuple, list[int | None]] = {}
    for r in records:
        key = (r.shape, r.task, r.cell_length, r.policy, r.budget)
        groups.setdefault(key, []).append(float(r.score))
        held.setdefault(key, []).append(r.kv_bytes_bf16)
    out = []
    for (shape, task, length, policy, budget), scores in groups.items():
        interval = wilson(sum(scores), len(scores))
        sizes = held[shape, task, length, policy, budget]
        mean_bytes = None if None in sizes else sum(sizes) / len(sizes)
        out.append(RulerCell(shape, task, length, policy, budget, len(scores), sum(scores) / len(scores),
                             interval.low, interval.high, kv_bytes_bf16=mean_bytes))
    out_of_reach = beyond(records, floor)
    for c in out:
        c.beyond = (c.protocol, c.task, c.length) in out_of_reach
    out.sort(key=lambda c: (c.protocol, c.task, c.length, budget_order(c.budget), c.policy))
    return out


@dataclass(frozen=True)
class TaskScore:
    """One policy's RULER answers at one budget within the model's reach, and the full cache's on the same ones.

    `hits` and `full_hits` are sums of scores in [0, 1] over the same `n` answers (a fractional score counts as
    that many successes of one trial, as in every cell). `pairs`: per answer (its unit, the policy's score, the
    full cache's), sorted by unit: what the paired judgements (`stats.tolerance`) read."""

    hits: float
    full_hits: float
    n: int
    pairs: tuple[tuple[tuple, float, float], ...] = ()

    @property
    def rate(self) -> float:
        return self.hits / self.n

    @property
    def full_rate(self) -> float:
        return self.full_hits / self.n

    @property
    def interval(self) -> Interval:
        return wilson(self.hits, self.n)

    @property
    def full_interval(self) -> Interval:
        return wilson(self.full_hits, self.n)

    @property
    def scores(self) -> list[float]:
        return [p for _, p, _ in self.pairs]

    @property
    def full_scores(self) -> list[float]:
        return [f for _, _, f in self.pairs]

    def by_unit(self) -> dict[tuple, float]:
        return {unit: p for unit, p, _ in self.pairs}

    def text(self) -> str:
        return f"{hits_text(self.hits)}/{self.n} {self.interval.text()}"

    def full_text(self) -> str:
        return f"{hits_text(self.full_hits)}/{self.n} {self.full_interval.text()}"


def hits_text(hits: float) -> str:
    """A sum of scores as a count: whole where it is whole, else to one decimal (a list task's partial answers sum
    to fractions such as 44.8333, whose later digits say nothing at these sample sizes; six thirds sum to
    2.0000000000000004 in floating point, which is 2)."""
    return f"{hits:.0f}" if abs(hits - round(hits)) < 1e-9 else f"{hits:.1f}"


def _unit(r: RulerRecord) -> tuple:
    """What one answer answers: the same for every policy and budget (and the full cache)."""
    return (r.shape, r.task, r.cell_length, r.sample, r.question)


def _counted(records: list[RulerRecord], floor: float) -> list[tuple[RulerRecord, tuple, float]]:
    """The bounded answers a task figure counts, each with its unit and the full cache's score on that unit:
    those of a (protocol, task, length) within reach (`beyond` ones left out) that the full cache answered too."""
    out_of_reach = beyond(records, floor)
    full = {_unit(r): float(r.score) for r in records if r.budget == "full"}
    counted = []
    for r in records:
        unit = _unit(r)
        if r.budget != "full" and unit in full and unit[:3] not in out_of_reach:
            counted.append((r, unit, full[unit]))
    return counted


def _sums(counted: Iterable[tuple[RulerRecord, tuple, float]]) -> dict[tuple[str, str], TaskScore]:
    """Per (policy, budget) the `TaskScore` of the answers `counted` holds."""
    found: dict[tuple[str, str], list[tuple[tuple, float, float]]] = {}
    for r, unit, full_score in counted:
        found.setdefault((r.policy, r.budget), []).append((unit, float(r.score), full_score))
    return {key: TaskScore(sum(p for _, p, _ in pairs), sum(f for _, _, f in pairs), len(pairs),
                           tuple(sorted(pairs, key=lambda x: tuple(map(str, x[0])))))
            for key, pairs in found.items()}


def task_scores(records: Iterable[RulerRecord], floor: float = FLOOR) -> dict[tuple[str, str], TaskScore]:
    """Per (policy as written, budget as written) its `TaskScore`: every answer of a (protocol, task, length)
    within reach that the full cache answered too (`beyond` ones left out)."""
    return _sums(_counted(list(records), floor))


#: the protocol the verdict judges on, the first of these a run holds: the question-agnostic one first (the service
#: that reuses a compressed context), the flattering `aware` last
JUDGED_ORDER = ("agnostic", "stream", "multi-requests", "multi-turns", "multi-aware-requests", "aware")


def judged_protocol(records: Iterable[RulerRecord]) -> str | None:
    """The protocol the verdict judges a run's tasks on (`JUDGED_ORDER`; another name after those), or None."""
    shapes = {r.shape for r in records}
    order = [p for p in JUDGED_ORDER if p in shapes] + sorted(shapes - set(JUDGED_ORDER))
    return order[0] if order else None


@dataclass(frozen=True)
class Judged:
    """What the verdict reads of the tasks: the `protocol`, the `scores` of the policies that answered every
    answer their budget asks (`task_scores`, keyed (policy, budget)), and `partial`: (policy, budget) ->
    (answered, asked) for those that answered fewer, left out of the ranking."""

    protocol: str | None
    scores: dict[tuple[str, str], TaskScore]
    partial: dict[tuple[str, str], tuple[int, int]]


def judged(records: Iterable[RulerRecord], floor: float = FLOOR) -> Judged:
    """The tasks as the verdict judges them: one protocol (`judged_protocol`), and per budget only the policies
    that answered every answer (within reach, the full cache's too) that some policy at that budget answered. A
    policy of the run with fewer (none, where it ran only under other protocols) is `partial`."""
    records = list(records)
    protocol = judged_protocol(records)
    everyone = {(r.policy, r.budget) for r in records if r.budget != "full"}  # a policy of another protocol too
    counted = _counted([r for r in records if r.shape == protocol], floor)
    units: dict[tuple[str, str], set[tuple]] = {}
    for r, unit, _ in counted:
        units.setdefault((r.policy, r.budget), set()).add(unit)
    asked: dict[str, set[tuple]] = {}
    for (_, budget), found in units.items():
        asked.setdefault(budget, set()).update(found)
    complete = {key for key, found in units.items() if found == asked[key[1]]}
    scores = _sums(c for c in counted if (c[0].policy, c[0].budget) in complete)
    partial = {key: (len(units.get(key, ())), len(asked[key[1]])) for key in sorted(everyone)
               if key not in complete and key[1] in asked}
    return Judged(protocol, scores, partial)


def fmt(cell: RulerCell) -> str:
    return f"{cell.accuracy:.2f} [{cell.low:.2f}, {cell.high:.2f}]" + (" †" if cell.beyond else "")


def bytes_table(found: Sequence[RulerCell]) -> Table | None:
    """The KV bytes beside the accuracies: per protocol, task@length and budget, the full cache's and each policy's
    MiB per sequence at bf16 once the context was compressed (a quantized row holds fewer bytes at the same
    entries). None where no record holds the figure."""
    if all(c.kv_bytes_bf16 is None for c in found):
        return None
    policies, full, rows = _layout(found)
    body = [[protocol, where, budget, _mib(full.get((protocol, where)))] + [_mib(row.get(p)) for p in policies]
            for (protocol, where, budget), row in rows.items()]
    return Table(["protocol", "task@length", "budget", "full, KV MiB/seq (bf16)"] + policies, body,
                 ["left", "left", "right", "right"] + ["right"] * len(policies))


def _mib(cell: RulerCell | None) -> str:
    return mib(cell.kv_bytes_bf16 if cell is not None else None)


def _layout(found: Sequence[RulerCell]) -> tuple[list[str], dict[tuple, RulerCell], dict[tuple, dict[str, RulerCell]]]:
    """What both RULER tables lay out: the policies (columns, first-seen order), the full cache's cell per
    (protocol, task@length), and per (protocol, task@length, budget) each policy's cell."""
    policies = list(dict.fromkeys(c.policy for c in found if c.budget != "full"))
    full = {(c.protocol, c.where): c for c in found if c.budget == "full"}
    rows: dict[tuple, dict[str, RulerCell]] = {}
    for c in found:
        if c.budget != "full":
            rows.setdefault((c.protocol, c.where, c.budget), {})[c.policy] = c
    return policies, full, rows


def ruler_table(found: Sequence[RulerCell]) -> Table:
    """Rows: protocol, task@length, budget; columns: the full cache on the same prompts, then each policy:
    accuracy [95% interval]. A task with the full cache alone gets one row (budget `full`)."""
    policies, full, rows = _layout(found)
    for protocol, where in full:
        if not any(k[:2] == (protocol, where) for k in rows):
            rows[(protocol, where, "full")] = {}
    body = []
    for (protocol, where, budget), row in rows.items():
        ref = full.get((protocol, where))
        counts = sorted({c.n for c in row.values()} | ({ref.n} if ref else set()))
        # cells of one row may hold different numbers of answers (a policy added to a run later): each says its own
        mixed = len(counts) > 1

        def text(cell: RulerCell, mixed: bool = mixed) -> str:
            return fmt(cell) + (f" n={cell.n}" if mixed else "")

        body.append([protocol, where, budget, f"{counts[0]}–{counts[-1]}" if mixed else str(counts[0]),
                     text(ref) if ref else "-"] + [text(row[p]) if p in row else "-" for p in policies])
    return Table(["protocol", "task@length", "budget", "n", "full"] + policies, body,
                 ["left", "left", "right", "right", "right"] + ["right"] * len(policies))


def spearman(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Spearman's rho (scipy.stats.spearmanr: Pearson correlation of average ranks); None when either side has no
    spread, or fewer than two values."""
    if len(a) < 2 or len(set(a)) < 2 or len(set(b)) < 2:
        return None
    return float(stats.spearmanr(a, b).statistic)


def rank_agreement(ppl: Sequence[PplRecord], answers: Sequence[RulerRecord], floor: float = FLOOR) -> list[dict]:
    """Per protocol and budget: the policies in both, their PPL and task rate (`task_scores` of that protocol's
    answers), and Spearman's rho between -PPL and the rate (+1: perplexity ranks the policies as the tasks do)."""
    by_budget: dict[str, dict[str, float]] = {}
    for r in ppl:
        if r.kind == "policy" and r.budget is not None:
            by_budget.setdefault(str(r.budget), {})[r.name] = r.ppl
    out = []
    for protocol in dict.fromkeys(r.shape for r in answers):
        scores = task_scores([r for r in answers if r.shape == protocol], floor)
        for budget, ppls in by_budget.items():
            both = [p for p in ppls if (p, budget) in scores]
            if len(both) < 2:
                continue
            accuracy = [scores[(p, budget)].rate for p in both]
            rho = spearman([-ppls[p] for p in both], accuracy)
            out.append({"protocol": protocol, "budget": budget, "policies": both,
                        "ppl": [ppls[p] for p in both], "accuracy": accuracy, "rho": rho})
    return out
