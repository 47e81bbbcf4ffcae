"""Generation failure modes under a compressed context: looping, and forgetting the start.

Each trial states a fact in the first sentence of a long prompt ("The name of the
lighthouse keeper is Ingrid."), follows it with essay text, asks for the fact at the
end, compresses the whole prompt to the budget and decodes greedily. Two numbers per
output:

* recall: the fact's value appears in the output. The fact is only at the very start,
  so a policy that keeps the sinks and the recent window but drops the middle and the
  start of the prompt's content cannot recall it.
* repetition: the share of the output's token 4-grams that already occurred earlier
  in the output. A healthy continuation is near 0; a model that lost its context
  falls into loops and climbs towards 1.

`chat=True` (the default) asks through the chat template and stops at the end of the
turn: a healthy answer is short, a broken one loops until `max_new_tokens`. `chat=False`
(or a tokenizer without a template) is a plain continuation after an "Answer: The name
of ... is" cue, with no stop token. Every policy reads the same seeded prompts; all but
the prompt's last token are compressed, so every output token reads the compressed
cache only.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..data import load_text, stream_start, tokenize
from ..errors import KvevictError
from ..policies.budget import Budget, budget_label, parse_budget
from ..position_modes import DEFAULT_POSITIONS
from ..progress import bars
from .compress import compress_prompt, greedy
from .needle import _batches, check_budgets, max_positions
from .prompts import essay_span, frame, question_ids, stop_ids

FACTS = [
    ("the lighthouse keeper", "name", ["Balthazar", "Ingrid", "Marisol", "Theodora", "Octavian", "Wilhelmina",
                                       "Leopold", "Ottoline", "Casimir", "Esmeralda"]),
    ("the locker", "number", [str(n) for n in (4817, 2953, 7361, 6029, 8534, 3196, 5742, 9408, 1685, 7270)]),
]


def repetition_rate(tokens: Sequence[int], n: int = 4) -> float:
    """Share of the n-grams of `tokens` that already occurred earlier in `tokens` (0 if none fit)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


@dataclass
class GenPrompt:
    length: int
    trial: int
    kind: str
    answer: str
    ids: torch.Tensor


class GenPromptMaker:
    """Seeded prompts: fact, essay text, question about the fact."""

    def __init__(self, tokenizer, text: str = "pg-essays", seed: int = 0, chat: bool = True) -> None:
        self.tokenizer = tokenizer
        self.corpus = tokenize(load_text(text), tokenizer)
        self.frame = frame(tokenizer) if chat else None
        self.chat = bool(self.frame and self.frame.chat)
        self.seed = seed

    def make(self, length: int, trial: int) -> GenPrompt:
        rng = random.Random(f"generation:{self.seed}:{length}:{trial}")
        subject, kind, values = FACTS[trial % len(FACTS)]
        value = rng.choice(values)
        fact = tokenize(f"The {kind} of {subject} is {value}.\n\n", self.tokenizer)
        question = f"What is the {kind} of {subject}?"
        body = essay_span(self.corpus, self.tokenizer, rng.randrange(self.corpus.numel()), length)
        if self.frame is not None and self.frame.chat:
            before, tail = self.frame.before, question_ids(question, self.tokenizer, self.frame)
        else:
            before = torch.tensor(stream_start(self.tokenizer), dtype=torch.long)  # Gemma's BOS, see prompts.frame
            tail = tokenize(f"\n\nQuestion: {question}\nAnswer: The {kind} of {subject} is", self.tokenizer)
        ids = torch.cat([before, fact, body, tail])
        return GenPrompt(length, trial, kind, value, ids)


@dataclass
class GenerationResult:
    records: list[dict] = field(default_factory=list)
    chat: bool = False
    seconds: float = 0.0

    def summary(self) -> list[dict]:
        """One row per (policy, budget): mean repetition, recall rate, mean output length."""
        groups: dict[tuple, list[dict]] = {}
        for r in self.records:
            groups.setdefault((r["policy"], r["budget"]), []).append(r)
        rows = []
        for (policy, budget), items in groups.items():
            rows.append(
                {
                    "policy": policy,
                    "budget": budget,
                    "repetition": sum(r["repetition"] for r in items) / len(items),
                    "recall": sum(r["recalled"] for r in items) / len(items),
                    "output_tokens": sum(r["output_tokens"] for r in items) / len(items),
                    "trials": len(items),
                }
            )
        return rows

    def to_dict(self) -> dict:
        return {"rows": self.summary(), "records": self.records, "chat": self.chat, "seconds": self.seconds}


def run_generation(
    model,
    tokenizer,
    policies: Sequence[str] = ("full", "streamingllm"),
    budgets: Sequence[Budget] = ("25%",),
    length: int = 1000,
    trials: int = 4,
    max_new_tokens: int = 64,
    seed: int = 0,
    text: str = "pg-essays",
    positions: str = DEFAULT_POSITIONS,
    chat: bool = True,
    ngram: int = 4,
    progress: bool = True,
    on_record: Callable[[dict], None] | None = None,
    prefill_chunk: int | None = None,
) -> GenerationResult:
    """Greedy continuations of the same seeded long prompts under every policy and budget (`prefill_chunk`:
    tokens per forward of each prompt's compressed part, `compress`'s `chunk`; None: one forward)."""
    _check_counts(trials, length, max_new_tokens)
    budgets = [parse_budget(b) for b in budgets]
    maker = GenPromptMaker(tokenizer, text, seed, chat)
    prompts = [maker.make(length, trial) for trial in range(trials)]
    _check_fits(model, prompts, length, max_new_tokens)
    check_budgets(policies, budgets, [p.ids.numel() - 1 for p in prompts], positions)
    plan = _batches(policies, budgets)
    stops = stop_ids(tokenizer) if maker.chat else []
    result = GenerationResult(chat=maker.chat)
    t0 = time.perf_counter()
    with bars(progress) as bar:
        task = bar.add_task("generation", total=len(prompts) * len(plan))
        for prompt in prompts:
            for specs, budget in plan:
                started = time.perf_counter()
                state = compress_prompt(model, prompt.ids, specs, budget, positions, tokenizer=tokenizer,
                                        chunk=prefill_chunk)
                outputs = greedy(model, state, max_new_tokens, stops)
                seconds = time.perf_counter() - started
                for spec, output in zip(specs, outputs, strict=True):
                    text_out = tokenizer.decode(output, skip_special_tokens=True)
                    record = {"policy": spec, "budget": "full" if state.budget is None else budget_label(budget),
                              "budget_tokens": state.budget, "positions": positions, "length": length}
                    record = _record(prompt, output, text_out, ngram, seconds, record)
                    result.records.append(record)
                    if on_record is not None:
                        on_record(record)
                bar.advance(task)
    result.seconds = time.perf_counter() - t0
    return result


def _check_counts(trials: int, length: int, max_new_tokens: int) -> None:
    if trials < 1:
        raise KvevictError(f"trials must be at least 1, got {trials}")
    if length < 16:
        raise KvevictError(f"prompt length {length} is too short: use at least 16 tokens of text")
    if max_new_tokens < 1:
        raise KvevictError(f"max_new_tokens must be at least 1, got {max_new_tokens}")


def _check_fits(model, prompts: list[GenPrompt], length: int, max_new_tokens: int) -> None:
    """Every prompt and its continuation within the model's context."""
    limit = max_positions(model)
    longest = max(p.ids.numel() for p in prompts) + max_new_tokens
    if limit is not None and longest > limit:
        raise KvevictError(
            f"prompts of {length} tokens plus {max_new_tokens} generated need {longest} positions, more than the "
            f"model's context of {limit}: lower the length"
        )


def _record(prompt: GenPrompt, output: list[int], text_out: str, ngram: int, seconds: float, cell: dict) -> dict:
    """One continuation's record: the cell it ran in (policy, budget, positions, length), then what it wrote."""
    return {
        "task": "generation", **cell,
        "trial": prompt.trial,
        "fact": prompt.kind,
        "expected": prompt.answer,
        "output": text_out,
        "output_tokens": len(output),
        "recalled": prompt.answer.lower() in text_out.lower(),
        "repetition": repetition_rate(output, ngram),
        "prompt_tokens": prompt.ids.numel(),
        "seconds": seconds,
    }
