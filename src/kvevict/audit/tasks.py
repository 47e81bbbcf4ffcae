"""Tasks through the endpoint: RULER's tasks, the user's QA file and the generation failure modes (looping,
forgetting a fact stated only at the start), sent to the deployment and the reference alike, scored alike,
and judged paired by the verdict's rule (`tolerance.judge_pair`: the accuracy drop against the reference).

Prompts come from kvevict's own generators (`eval/ruler`, `eval/generation`) in the model's tokenizer and
chat template, sent as token ids. By default a prompt fills the deployment's context to within a few tokens,
so its answer is generated across the eviction point; a longer one shows what the server does with a prompt
beyond its KV budget: llama-server refuses it, a server that cuts it says `truncated` or evaluates fewer
tokens than it was sent. Either is reported as such, never scored as eviction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..stats.tolerance import Judgement, Tolerance, judge_pair
from .api import Ask, Generation, generate
from .client import ServerError
from .records import Records
from .stream import Side

#: tokens between a task prompt and the deployment's context: its answer starts this close to the shift
MARGIN = 8


@dataclass(frozen=True)
class TaskItem:
    """One prompt: its task, ids, what the answer must hold, how it is scored, and how long it may run."""

    task: str
    index: int
    ids: tuple[int, ...]
    answers: tuple[str, ...]
    metric: str  # "all", "part" (RULER's), "recall" (a fact, with repetition measured), "fact"/"instruction"
    max_new: int
    messages: tuple[dict, ...] = ()  # chat messages (the conversation on the chat route)


def ruler_items(tokenizer, tasks: Sequence[str], length: int, samples: int, seed: int = 0, text: str = "pg-essays",
                qa: str | None = None) -> list[TaskItem]:
    """RULER prompts of `length` tokens with the answer (or the QA file's rows), in the model's template."""
    from ..eval.ruler.framing import framing
    from ..eval.ruler.qa import QaFile, load_qa
    from ..eval.ruler.registry import get_task
    from ..eval.ruler.sample import encode, fit, seeded
    from ..eval.ruler.words import Material

    shape, material, out = framing(tokenizer), Material(text), []
    if qa:
        task = QaFile(tuple(load_qa(qa)))
        for i in range(min(samples, len(task.rows))):
            prompt = encode(task.build(0, i, 0, seeded(seed, "qa", 0, i)), 0, shape, task.tokens_to_generate)
            out.append(TaskItem("qa", i, tuple(prompt.ids.tolist()), tuple(prompt.sample.question.answers),
                                task.metric, task.tokens_to_generate))
    for name in tasks:
        task = get_task(name)
        for i in range(samples):
            prompt = fit(task, length, i, seed, shape, material)
            out.append(TaskItem(name, i, tuple(prompt.ids.tolist()), tuple(prompt.sample.question.answers),
                                task.metric, task.tokens_to_generate))
    return out


def generation_items(tokenizer, length: int, trials: int, max_new: int = 64, seed: int = 0,
                     text: str = "pg-essays") -> list[TaskItem]:
    """`eval/generation`'s prompts (a fact first, essay text, the question last) of about `length` tokens."""
    from ..eval.generation import GenPromptMaker

    maker = GenPromptMaker(tokenizer, text, seed)
    items = []
    for trial in range(trials):
        first = maker.make(length, trial)
        over = first.ids.numel() - length  # the frame and question come on top of the essay span
        prompt = maker.make(max(16, length - over), trial) if over > 0 else first
        items.append(TaskItem("generation", trial, tuple(prompt.ids.tolist()), (prompt.answer,), "recall", max_new))
    return items


def conversation_items(tokenizer, count: int, chat: bool, max_new: int = 48, turns: int = 12) -> list[TaskItem]:
    """`eval/conversation`'s conversations (a system rule and facts early, filler turns, probes late), one item per
    probe: as chat messages sent as they are (`chat`), or rendered with the tokenizer's chat template into ids."""
    from ..eval.conversation import build_conversation, messages

    items = []
    for seed in range(count):
        conversation = build_conversation(seed, turns=turns)
        for i, probe in enumerate(conversation.probes):
            found = messages(conversation, probe)
            ids = () if chat else tuple(tokenizer.apply_chat_template(found, add_generation_prompt=True, tokenize=True,
                                                                      return_dict=False))
            items.append(TaskItem(f"conversation-{probe.kind}", seed * 100 + i, ids, (probe.answer,), probe.kind,
                                  max_new, tuple(found) if chat else ()))
    return items


@dataclass
class TaskRow:
    """One task's paired scores: the deployment's and the reference's per prompt, the judgement, and what the
    server did with prompts it could not hold (`refused`, `truncated`: prompt indices)."""

    task: str
    scores: list[float] = field(default_factory=list)
    reference: list[float] = field(default_factory=list)
    repetition: list[float] = field(default_factory=list)  # deployment, reference per prompt (generation only)
    repetition_ref: list[float] = field(default_factory=list)
    refused: list[int] = field(default_factory=list)
    truncated: list[int] = field(default_factory=list)
    judgement: Judgement | None = None

    def as_dict(self) -> dict:
        j = self.judgement
        return {"task": self.task, "n": len(self.scores), "accuracy": _mean(self.scores),
                "reference": _mean(self.reference), "repetition": _mean(self.repetition),
                "repetition_reference": _mean(self.repetition_ref), "refused": self.refused,
                "truncated": self.truncated, "outcome": j.outcome if j else None, "judged": j.text() if j else None}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _answer(side: Side, item: TaskItem, records: Records, label: str) -> Generation | str:
    """The side's answer to `item` (from the records where it was sent), or "refused" where the server refused
    a prompt beyond its context."""
    ask = Ask(n_predict=item.max_new, ids=item.ids, messages=item.messages)
    key = side.key(ask)
    found = records.get(key)
    if found is not None:
        return "refused" if found.get("refused") else records.generation(key)
    try:
        answer = generate(side.client, side.route, ask, side.model)
    except ServerError as exc:
        if "context" not in str(exc):
            raise
        records.put({"key": key, "kind": f"task-{label}", "refused": True, "reason": str(exc)})
        return "refused"
    records.keep_generation(key, f"task-{label}", answer, task=item.task, index=item.index)
    return answer


def _score(item: TaskItem, answer: Generation, tokenizer) -> tuple[float, float | None]:
    from ..eval.generation import repetition_rate
    from ..eval.ruler.scoring import score

    if item.metric in ("fact", "instruction"):
        from ..eval.conversation import Probe
        from ..eval.conversation import score as passes

        return float(passes(Probe("", item.answers[0], item.metric), answer.text)), None
    if item.metric == "recall":
        tokens = tokenizer(answer.text, add_special_tokens=False)["input_ids"]
        return float(item.answers[0].lower() in answer.text.lower()), repetition_rate(tokens)
    return score(item.metric, answer.text, item.answers), None


def run_tasks(deployment: Side, reference: Side, items: Sequence[TaskItem], records: Records, tokenizer,
              tol: Tolerance) -> list[TaskRow]:
    """Every item on both sides; one `TaskRow` per task, judged paired on the prompts both answered."""
    rows: dict[str, TaskRow] = {}
    for item in items:
        row = rows.setdefault(item.task, TaskRow(item.task))
        dep = _answer(deployment, item, records, "deployment")
        ref = _answer(reference, item, records, "reference")
        if dep == "refused":
            row.refused.append(item.index)
            continue
        if ref == "refused":
            continue
        if dep.prompt_tokens is not None and dep.prompt_tokens < len(item.ids):  # it cut the prompt
            row.truncated.append(item.index)
            continue
        (a, rep_a), (b, rep_b) = _score(item, dep, tokenizer), _score(item, ref, tokenizer)
        row.scores.append(a)
        row.reference.append(b)
        if rep_a is not None:
            row.repetition.append(rep_a)
            row.repetition_ref.append(rep_b)
    for row in rows.values():
        if row.scores:
            row.judgement = judge_pair(row.scores, row.reference, tol)
    return list(rows.values())

