"""One RULER sample: the text before the question, the questions, and what was hidden.

A task builds a `Sample` from a number of haystack units (words, sentences, needles)
and a seeded random generator; `fit` finds the most units whose prompt, in the model's
own tokenizer and chat template, leaves room for the task's answer inside the target
length (RULER's binary search: prompt tokens + tokens to generate <= length).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ...errors import KvevictError
from .framing import Framing
from .scoring import score


@dataclass
class Question:
    """What is asked after the context, the text the answer starts with, and the references."""

    text: str  # with its leading separator ("\nWhat are all ...?")
    answer_prefix: str  # RULER's answer prefix (" The special magic numbers for ... are")
    answers: list[str]
    #: read to the end of the turn even with one reference: an answer judged by how it ends, not by its first line
    reads_whole: bool = False


@dataclass
class Sample:
    """A generated sample. `head` is the instruction and the context: what `agnostic` compresses.

    `question` is RULER's question; `per_key` asks each hidden key on its own (the
    questions of the `multi` protocol; empty when the task hides one thing). `needles`
    are the hidden texts, in context order, and `depths` where they were put (shares of
    the haystack, in [0, 1)).
    """

    task: str
    index: int
    head: str
    question: Question
    per_key: list[Question] = field(default_factory=list)
    needles: list[str] = field(default_factory=list)
    depths: list[float] = field(default_factory=list)
    units: int = 0


class Task(Protocol):
    """A task of the grid: a name, its family, its answer length, its metric, a builder, and (`RulerTask`)
    how a sample becomes token ids and how an answer is scored."""

    name: str
    family: str
    tokens_to_generate: int
    metric: str  # "all" (every reference, averaged) or "part" (any reference)

    def build(self, units: int, index: int, length: int, rng: random.Random, material) -> Sample: ...

    def prompt(self, sample: Sample, length: int, framing: Framing) -> Prompt: ...

    def score(self, answer: str, references: Sequence[str]) -> float: ...


class RulerTask:
    """What a task does unless it says otherwise: RULER's prompt (`encode`) and RULER's score (`metric`).

    `asks_several`: whether a sample hides several keys, each asked on its own (`Sample.per_key`), as the
    `multi` protocol needs.
    """

    asks_several: bool = False

    def prompt(self, sample: Sample, length: int, framing: Framing) -> Prompt:
        """The sample's token ids inside the model's template, with the task's answer length."""
        return encode(sample, length, framing, self.tokens_to_generate)

    def score(self, answer: str, references: Sequence[str]) -> float:
        """The answer's score in [0, 1] by the task's RULER metric (`scoring.METRICS`)."""
        return score(self.metric, answer, references)


@dataclass
class Prompt:
    """A sample as token ids: the context (template start, instruction, haystack) and each question's ids."""

    sample: Sample
    length: int  # the target length (prompt + answer)
    context: torch.Tensor  # [C]
    question: torch.Tensor  # [Q]: RULER's question, the end of the user turn and the answer prefix
    per_key: list[torch.Tensor]  # the multi protocol's questions, as first turns
    follow_ups: list[torch.Tensor]  # the same questions as later turns of a dialogue
    answer_tokens: int = 32  # the task's answer length (RULER's tokens_to_generate)

    @property
    def ids(self) -> torch.Tensor:
        return torch.cat([self.context, self.question])

    @property
    def tokens(self) -> int:
        return self.context.numel() + self.question.numel()


def encode(sample: Sample, length: int, framing: Framing, answer_tokens: int) -> Prompt:
    """Token ids of a sample inside the model's template."""
    return Prompt(
        sample, length, framing.context_ids(sample.head), framing.question_ids(sample.question, first=True),
        [framing.question_ids(q, first=True) for q in sample.per_key],
        [framing.question_ids(q, first=False) for q in sample.per_key] if framing.turn is not None else [],
        answer_tokens,
    )


def seeded(seed: int, task: str, length: int, index: int) -> random.Random:
    """The generator of one sample: the same prompt for the same (seed, task, length, index)."""
    return random.Random(f"ruler:{seed}:{task}:{length}:{index}")


def fit(task: Task, length: int, index: int, seed: int, framing: Framing, material) -> Prompt:
    """The sample with the most haystack units whose prompt + answer fits in `length` tokens.

    Every call of `build` gets a fresh generator from the same seed, so the keys and
    values stay the same while the haystack grows; the search is RULER's (largest size
    that fits). Raises when not even one unit fits.
    """
    budget = length - task.tokens_to_generate

    def tokens(units: int) -> int:
        return task.prompt(task.build(units, index, length, seeded(seed, task.name, length, index), material),
                           length, framing).tokens

    probe = 64
    rate = max(1e-3, (tokens(probe) - tokens(1)) / (probe - 1))
    lo, hi, best = 1, max(2, int(3 * budget / rate) + probe), None
    if tokens(1) > budget:
        raise KvevictError(
            f"length {length} is too short for {task.name}: its prompt alone takes {tokens(1)} tokens and the "
            f"answer {task.tokens_to_generate}: use lengths of at least {tokens(1) + task.tokens_to_generate}"
        )
    while lo <= hi:
        mid = (lo + hi) // 2
        if tokens(mid) <= budget:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    sample = task.build(best, index, length, seeded(seed, task.name, length, index), material)
    return task.prompt(sample, length, framing)
