"""The RULER grid: tasks x lengths x samples, the full cache first, then every policy at every budget.

Every sample is made once (seeded: the same prompt for every policy, budget and
rerun) and answered by the full cache first (one row), then by each batch of policies at
every budget (rows sharing one context prefill; where the protocol allows, one prefill
for all budgets and for the full cache too, see `protocols.answer_budgets`).
`on_records` receives a batch's records at each budget as soon as they are answered, and
`done` (record keys already stored) skips the budgets that an interrupted earlier run
finished, so a rerun only computes what is missing. Nothing is kept between samples:
memory stays flat in the sample count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from ...data import stream_start
from ...errors import KvevictError
from ...policies import check_policy, is_full_cache, shared_batches
from ...policies.budget import Budget, budget_label, parse_budget, resolve_budget
from ...policies.engine_defaults import with_stream_start
from ...position_modes import DEFAULT_POSITIONS
from ..reconstruction import KeptScores
from .framing import framing
from .protocol_kinds.base import Protocol
from .protocol_kinds.registry import check_protocol, get_protocol
from .protocols import answer_budgets, check_aware, full_shares_prefill
from .qa import QaFile
from .registry import get_task, several_keys
from .sample import Prompt, fit, seeded
from .words import Material


@dataclass
class RulerGrid:
    """What to run. `qa` replaces `tasks` and `lengths` by a user's QA file (its lines, at their own lengths)."""

    tasks: list[str] = field(default_factory=lambda: ["niah_single_1"])
    lengths: list[int] = field(default_factory=lambda: [1000])
    samples: int = 10
    policies: list[str] = field(default_factory=lambda: ["window", "streamingllm", "h2o", "snapkv"])
    budgets: list[Budget] = field(default_factory=lambda: ["50%", "25%"])
    protocol: str = "agnostic"
    form: str = "requests"
    seed: int = 0
    positions: str = DEFAULT_POSITIONS
    text: str = "pg-essays"
    qa: QaFile | None = None
    max_new_tokens: int | None = None  # None: RULER's answer length of each task
    only: tuple[int, ...] | None = None  # the sample indices to answer (a shard of the grid); None: every one
    scores: str | None = None  # a folder keeping reconstruction scores between runs (`reconstruction.KeptScores`)

    def check(self) -> None:
        """Everything that can be refused before a model is loaded."""
        check_protocol(self.protocol, self.form)
        if self.samples < 1:
            raise KvevictError(f"--samples must be at least 1, got {self.samples}")
        if self.max_new_tokens is not None and self.max_new_tokens < 0:  # 0, like None: RULER's length
            raise KvevictError(f"--max-new-tokens must be 0 (RULER's answer length) or positive, "
                               f"got {self.max_new_tokens}")
        if self.qa is None:
            for name in self.tasks:
                get_task(name)
            if not self.lengths:
                raise KvevictError("no lengths given: pass e.g. --lengths 1000,2000,4000")
            for length in self.lengths:
                if length < 128:
                    raise KvevictError(f"length {length} is too short for a RULER prompt: use at least 128 tokens")
        if self.kind.asks_each_key:
            wrong = [t for t in self.tasks if not get_task(t).asks_several] if self.qa is None else ["qa"]
            if wrong:
                raise KvevictError(f"protocol {self.kind.name} needs several keys in one context, which "
                                   f"{', '.join(wrong)} does not hide: use {', '.join(several_keys())}")
        if self.kind.reads_question:
            check_aware(self.policies, self.protocol, self.form)
        for budget in self.budgets:
            budget = parse_budget(budget)
            if budget == "100%":
                raise KvevictError("budget 100% keeps the whole context: that is the full cache, which every run "
                                   "measures first; use budgets below 100%")
        for spec in self.bounded:
            check_policy(spec, None, self.positions)

    @property
    def kind(self) -> Protocol:
        """The protocol object `protocol` and `form` name (`protocol_kinds.registry`)."""
        return get_protocol(self.protocol, self.form)

    @property
    def bounded(self) -> list[str]:
        return [p for p in self.policies if not is_full_cache(p)]

    def batches(self) -> list[tuple[list[str], list[Budget]]]:
        """The full cache first, then the bounded policies in shared batches, each at every budget.

        The full cache (budget None) is the first budget of the first batch where one prefill serves
        it too (`protocols.full_shares_prefill`), else a batch of its own.
        """
        if self.bounded and not self.budgets:
            raise KvevictError("bounded policies need at least one budget: pass e.g. --budgets 50%,25%")
        budgets = [parse_budget(b) for b in self.budgets]
        batches = shared_batches(self.bounded)
        if batches and full_shares_prefill(self.protocol, self.form, batches[0]):
            return [(batches[0], [None, *budgets])] + [(batch, budgets) for batch in batches[1:]]
        return [(["full"], [None])] + [(batch, budgets) for batch in batches]


def record_key(protocol: str, form: str, task: str, length: int, sample: int, policy: str, budget: str,
               question: int) -> str:
    """A sample's answer for one policy, budget and question: what a rerun skips."""
    return f"ruler|{get_protocol(protocol, form).label}|{task}|{length}|{sample}|{policy}|{budget}|{question}"


def compressed_length(prompt: Prompt, protocol: str, form: str = "requests") -> int:
    """The tokens a budget share is taken of under the protocol (`Protocol.compressed_length`)."""
    return get_protocol(protocol, form).compressed_length(prompt)


def check_budget(prompt: Prompt, protocol: str, specs: Sequence[str], budget: Budget, form: str,
                 positions: str) -> int | None:
    """Entries of `budget` for this prompt, refused when it keeps everything or the policy cannot run at it
    in the position mode `positions`."""
    if budget is None:
        return None
    length = compressed_length(prompt, protocol, form)
    entries = resolve_budget(budget, length)
    if entries >= length:
        raise KvevictError(
            f"budget {budget_label(budget)} is {entries} entries for a {length}-token context "
            f"({prompt.sample.task}): it keeps the whole context, which is the full cache (measured anyway); "
            "use a smaller budget"
        )
    for spec in specs:
        try:
            check_policy(spec, entries, positions)
        except KvevictError as exc:
            raise KvevictError(f"budget {budget_label(budget)} is {entries} entries for a {length}-token context "
                               f"({prompt.sample.task}): {exc}") from None
    return entries


def prompts(grid: RulerGrid, tokenizer, limit: int | None) -> Iterator[Prompt]:
    """Every prompt of the grid, in run order (task, length, sample)."""
    shape, material = framing(tokenizer), Material(grid.text)
    if grid.qa is not None:
        for index in _indices(grid, min(grid.samples, len(grid.qa.rows))):
            sample = grid.qa.build(0, index, 0, seeded(grid.seed, "qa", 0, index))
            prompt = grid.qa.prompt(sample, 0, shape)
            prompt.length = prompt.tokens + prompt.answer_tokens
            check_length(prompt.length, limit, f"QA line {index + 1}")
            yield prompt
        return
    for name in grid.tasks:
        task = get_task(name)
        for length in grid.lengths:
            check_length(length, limit, f"length {length}")
            for index in _indices(grid, grid.samples):
                yield fit(task, length, index, grid.seed, shape, material)


def _indices(grid: RulerGrid, count: int) -> list[int]:
    """The sample indices of the grid below `count`: all, or the shard `grid.only` names."""
    return [i for i in range(count) if grid.only is None or i in grid.only]


def check_length(length: int, limit: int | None, what: str) -> None:
    if limit is not None and length > limit:
        raise KvevictError(f"{what} needs {length} positions with the answer, more than the model's context of "
                           f"{limit}: use lengths up to {limit}")


def preflight(grid: RulerGrid, tokenizer, limit: int | None) -> int:
    """Check every prompt against the model's context and every budget against every prompt, before any
    answer; returns the number of (batch, budget) cells the grid holds."""
    grid.check()
    plan = grid.batches()
    count = 0
    for prompt in prompts(grid, tokenizer, limit):
        grid.kind.check_prompt(prompt)
        for specs, budgets in plan:
            for budget in budgets:
                check_budget(prompt, grid.protocol, specs, budget, grid.form, grid.positions)
                count += 1
    return count


def _rows(specs: list[str], budget: Budget) -> list[str]:
    """The policy each answer at `budget` is recorded under: the full cache's is `full`."""
    return ["full"] if budget is None else specs


def _keys(grid: RulerGrid, prompt: Prompt, specs: list[str], budget: Budget, questions: int) -> list[str]:
    sample = prompt.sample
    return [record_key(grid.protocol, grid.form, sample.task, prompt.length, sample.index, spec, budget_label(budget),
                       q) for spec in _rows(specs, budget) for q in range(questions)]


def run_grid(model, tokenizer, grid: RulerGrid, done: set[str] = frozenset(),
             on_records: Callable[[list[dict]], None] | None = None, limit: int | None = None,
             on_skip: Callable[[], None] | None = None) -> list[dict]:
    """Answer every prompt of the grid with every batch; returns the new records (also given to `on_records`).
    A preset option that reads the model (llama.cpp's add-BOS) is read from `tokenizer` here."""
    grid = replace(grid, policies=with_stream_start(list(grid.policies), bool(stream_start(tokenizer))))
    preflight(grid, tokenizer, limit)
    plan = grid.batches()
    kept = KeptScores(Path(grid.scores)) if grid.scores is not None else None
    out: list[dict] = []
    for prompt in prompts(grid, tokenizer, limit):
        questions = grid.kind.questions(prompt.sample)
        for specs, budgets in plan:
            missing = [b for b in budgets if not all(k in done for k in _keys(grid, prompt, specs, b, len(questions)))]
            for _ in range(len(budgets) - len(missing)):
                if on_skip is not None:
                    on_skip()
            if not missing:
                continue
            entries = [check_budget(prompt, grid.protocol, specs, b, grid.form, grid.positions) for b in missing]
            replies = answer_budgets(model, tokenizer, prompt, specs, entries, grid.protocol, grid.form,
                                     grid.positions, grid.max_new_tokens, kept=kept)
            for budget, count, answers in zip(missing, entries, replies, strict=True):
                rows = _rows(specs, budget)
                # question by question, row by row
                records = [_record(grid, prompt, rows[i % len(rows)], budget, count, reply)
                           for i, reply in enumerate(answers)]
                if on_records is not None:
                    on_records(records)
                out += records
    return out


def _record(grid: RulerGrid, prompt: Prompt, spec: str, budget: Budget, count: int | None, reply) -> dict:
    """One answer as the record `records.schema.RulerRecord` reads, scored by its task (`RulerTask.score`)."""
    sample, label = prompt.sample, budget_label(budget)
    task = grid.qa if grid.qa is not None else get_task(sample.task)
    refs = grid.kind.questions(sample)[reply.question].answers
    return {
        "key": record_key(grid.protocol, grid.form, sample.task, prompt.length, sample.index, spec, label,
                          reply.question),
        "task": sample.task, "protocol": grid.protocol, "form": grid.kind.form,
        "length": prompt.length, "sample": sample.index, "question": reply.question,
        "policy": spec, "budget": label, "budget_tokens": count,
        "metric": task.metric, "score": task.score(reply.text, refs), "answers": refs,
        "output": reply.text, "prompt_tokens": prompt.tokens, "context_tokens": prompt.context.numel(),
        "depths": [round(d, 4) for d in sample.depths], "kept": reply.kept,
        "kv_bytes": reply.kv_bytes, "kv_bytes_bf16": reply.kv_bytes_bf16,
        "seconds": round(reply.seconds, 3), "seed": grid.seed,
    }
