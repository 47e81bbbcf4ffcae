"""Pass-key retrieval ("needle in a haystack") under a compressed context.

A sentence "The secret pass key is NNNNN." is spliced, at a sentence boundary near depth
d, into L tokens of essay text; the question comes after the text, inside the model's
chat template; the answer is decoded greedily and counts as a hit when it contains the
key. Each trial draws its key and its stretch of essay from a seed, and every depth and
policy of one trial reads the same haystack, so cells differ only by what they vary.

The prompt, question included, is compressed in one forward (SnapKV's protocol: its
observation window is the end of the prompt), all but its last token, which is then
read through the compressed cache so that no answer token sees more than was kept.
With `question_after=True`, only the haystack is compressed and the question is read
through the compressed cache (kvpress's question-agnostic protocol, what a reused
prefix cache faces).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..cache.model_info import text_config
from ..data import load_text, tokenize
from ..errors import KvevictError
from ..policies import check_policy, is_full_cache, shared_batches
from ..policies.budget import Budget, budget_label, parse_budget, resolve_budget
from ..position_modes import DEFAULT_POSITIONS
from ..progress import bars
from .compress import compress_prompt, greedy
from .prompts import Frame, essay_span, frame, question_ids, sentence_start, stop_ids

NEEDLE = "The secret pass key is {key}."
QUESTION = "What is the secret pass key? Answer with the number only."
MAX_NEW_TOKENS = 16


@dataclass
class NeedlePrompt:
    """One haystack with its needle, ready to run."""

    length: int
    depth: float
    trial: int
    key: str
    ids: torch.Tensor  # the whole prompt
    split: int  # ids[:split] end with the haystack; ids[split:] are the question and the turn's end
    needle_at: int  # index of the needle's first token in `ids`

    @property
    def needle_depth(self) -> float:
        """Where the needle landed, as a share of the haystack (after snapping to a sentence start)."""
        return 0.0 if self.length == 0 else (self.needle_at - (self.split - self.length)) / self.length


def check_grid(lengths: Sequence[int], depths: Sequence[float], trials: int) -> None:
    """Refuse an impossible grid before any model work."""
    if trials < 1:
        raise KvevictError(f"trials must be at least 1, got {trials}")
    if not lengths:
        raise KvevictError("no haystack lengths given: pass e.g. --lengths 1000,2000")
    if not depths:
        raise KvevictError("no depths given: pass e.g. --depths 0.1,0.5,0.9")
    for length in lengths:
        if length < 32:
            raise KvevictError(f"haystack length {length} is too short to hide a needle in: use at least 32 tokens")
    for depth in depths:
        if not 0.0 <= depth <= 1.0:
            raise KvevictError(f"depth {depth:g} is outside [0, 1]: 0 puts the needle first, 1 last")


def max_positions(model) -> int | None:
    """The longest sequence the model was trained for, from its config (None if unknown)."""
    return getattr(text_config(model), "max_position_embeddings", None)


class PromptMaker:
    """Builds the seeded needle prompts for one tokenizer and corpus."""

    def __init__(self, tokenizer, text: str = "pg-essays", seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.corpus = tokenize(load_text(text), tokenizer)
        if self.corpus.numel() < 32:
            raise KvevictError(f"text '{text}' has only {self.corpus.numel()} tokens: a haystack needs a longer text")
        self.frame: Frame = frame(tokenizer)
        self.question = question_ids(QUESTION, tokenizer, self.frame)
        self.seed = seed

    def overhead(self) -> int:
        """Prompt tokens beyond the haystack (template and question)."""
        return self.frame.before.numel() + self.question.numel()

    def make(self, length: int, depth: float, trial: int) -> NeedlePrompt:
        rng = random.Random(f"needle:{self.seed}:{length}:{trial}")
        key = str(rng.randint(10000, 99999))
        start = rng.randrange(self.corpus.numel())
        needle = tokenize(" " + NEEDLE.format(key=key) + " ", self.tokenizer)
        hay = essay_span(self.corpus, self.tokenizer, start, max(0, length - needle.numel()))
        pieces = self.tokenizer.convert_ids_to_tokens(hay.tolist())
        at = sentence_start(pieces, int(round(depth * hay.numel())))
        before = self.frame.before
        ids = torch.cat([before, hay[:at], needle, hay[at:], self.question])
        split = ids.numel() - self.question.numel()
        return NeedlePrompt(length, depth, trial, key, ids, split, before.numel() + at)


@dataclass
class NeedleResult:
    """Every trial's record, and the cells of the grid they aggregate into."""

    records: list[dict] = field(default_factory=list)
    chat_template: bool = True
    question_after: bool = False
    seconds: float = 0.0

    def cells(self) -> list[dict]:
        """One row per (policy, budget, length, depth): accuracy over trials."""
        groups: dict[tuple, list[dict]] = {}
        for r in self.records:
            groups.setdefault((r["policy"], r["budget"], r["length"], r["depth"]), []).append(r)
        cells = []
        for (policy, budget, length, depth), rows in groups.items():
            hits = sum(r["hit"] for r in rows)
            cells.append(
                {
                    "policy": policy,
                    "budget": budget,
                    "length": length,
                    "depth": depth,
                    "accuracy": hits / len(rows),
                    "trials": len(rows),
                    "budget_tokens": rows[0]["budget_tokens"],
                    "kv_bytes_bf16": _mean_bytes(rows),
                }
            )
        return cells

    def to_dict(self) -> dict:
        return {
            "cells": self.cells(),
            "records": self.records,
            "chat_template": self.chat_template,
            "question_after": self.question_after,
            "seconds": self.seconds,
        }


def _mean_bytes(rows: list[dict]) -> float | None:
    """The KV bytes at bf16 the cell's trials held once compressed, their mean (None where a record holds none)."""
    sizes = [r.get("kv_bytes_bf16") for r in rows]
    return None if None in sizes else sum(sizes) / len(sizes)


def _batches(policies: Sequence[str], budgets: Sequence[Budget]) -> list[tuple[list[str], Budget]]:
    """The full cache alone (once, whatever the budgets), then the bounded policies per budget
    (one batch, plus one for each policy that declares `own_batch`: pyramidkv, adakv:P)."""
    full = [p for p in policies if is_full_cache(p)]
    bounded = [p for p in policies if not is_full_cache(p)]
    plan: list[tuple[list[str], Budget]] = [([p], None) for p in full]
    if bounded:
        if not budgets:
            raise KvevictError("bounded policies need at least one budget: pass e.g. --budgets 50%,25%")
        plan += [(batch, budget) for budget in budgets for batch in shared_batches(bounded)]
    return plan


def check_budgets(
    policies: Sequence[str], budgets: Sequence[Budget], context_lengths: Sequence[int],
    positions: str = DEFAULT_POSITIONS,
) -> None:
    """Every bounded policy must be able to run at every budget, for every context length, in the
    position mode it will run in (an engine preset runs only in its engine's).

    A share budget (`25%`) only becomes entries against a context, so the same policy is
    checked once per context length, and the error says which length made it impossible.
    """
    for specs, budget in _batches(policies, budgets):
        for length in context_lengths:
            entries = resolve_budget(budget, length)
            for spec in specs:
                try:
                    check_policy(spec, entries, positions)
                except KvevictError as exc:
                    if entries is None:
                        raise
                    raise KvevictError(
                        f"budget {budget_label(budget)} is {entries} entries for a {length}-token context: {exc}"
                    ) from None


def run_needle(
    model,
    tokenizer,
    lengths: Sequence[int] = (1000,),
    depths: Sequence[float] = (0.1, 0.5, 0.9),
    trials: int = 3,
    policies: Sequence[str] = ("full",),
    budgets: Sequence[Budget] = ("50%",),
    seed: int = 0,
    text: str = "pg-essays",
    positions: str = DEFAULT_POSITIONS,
    question_after: bool = False,
    max_new_tokens: int = MAX_NEW_TOKENS,
    progress: bool = True,
    on_record: Callable[[dict], None] | None = None,
    prefill_chunk: int | None = None,
) -> NeedleResult:
    """Run the pass-key grid: lengths x depths x trials, each policy at each budget.

    Bounded policies of one budget run as rows of one batch; the full cache runs once
    per prompt. `on_record` sees each trial's record as it is finished (for a results
    store that survives interruption). `prefill_chunk`: tokens per forward of each prompt's
    compressed part (`compress`'s `chunk`; None: one forward).
    """
    check_grid(lengths, depths, trials)
    budgets = [parse_budget(b) for b in budgets]
    maker = PromptMaker(tokenizer, text, seed)
    limit = max_positions(model)
    for length in lengths:
        needed = length + maker.overhead() + max_new_tokens
        if limit is not None and needed > limit:
            raise KvevictError(
                f"haystack length {length} needs {needed} positions with the prompt and answer, more than the "
                f"model's context of {limit}: use lengths up to {limit - maker.overhead() - max_new_tokens}"
            )
    contexts = [length + maker.overhead() - (maker.question.numel() if question_after else 1) for length in lengths]
    check_budgets(policies, budgets, contexts, positions)
    plan = _batches(policies, budgets)
    stops = stop_ids(tokenizer)
    result = NeedleResult(chat_template=maker.frame.chat, question_after=question_after)
    t0 = time.perf_counter()
    with bars(progress) as bar:
        task = bar.add_task("needle", total=len(lengths) * len(depths) * trials * len(plan))
        for length in lengths:
            for trial in range(trials):
                for depth in depths:
                    prompt = maker.make(length, depth, trial)
                    for specs, budget in plan:
                        for record in _run_batch(model, tokenizer, prompt, specs, budget, positions,
                                                 question_after, max_new_tokens, stops, prefill_chunk):
                            result.records.append(record)
                            if on_record is not None:
                                on_record(record)
                        bar.advance(task)
    result.seconds = time.perf_counter() - t0
    return result


def _run_batch(
    model, tokenizer, prompt: NeedlePrompt, specs: list[str], budget: Budget, positions: str,
    question_after: bool, max_new_tokens: int, stops: list[int], prefill_chunk: int | None = None,
) -> list[dict]:
    t0 = time.perf_counter()
    state = compress_prompt(model, prompt.ids, specs, budget, positions, prompt.split if question_after else None,
                            tokenizer, prefill_chunk)
    answers = greedy(model, state, max_new_tokens, stops)
    seconds = time.perf_counter() - t0
    records = []
    for spec, answer in zip(specs, answers, strict=True):
        text = tokenizer.decode(answer, skip_special_tokens=True)
        records.append(
            {
                "task": "needle",
                "policy": spec,
                "budget": "full" if state.budget is None else budget_label(budget),
                "budget_tokens": state.budget,
                "positions": positions,
                "length": prompt.length,
                "depth": prompt.depth,
                "needle_depth": round(prompt.needle_depth, 4),
                "trial": prompt.trial,
                "key": prompt.key,
                "answer": text,
                "hit": prompt.key in text,
                "prompt_tokens": prompt.ids.numel(),
                "kept": state.kept,
                "kv_bytes": state.kv_bytes,  # what the row's cache held once the prompt was compressed
                "kv_bytes_bf16": state.kv_bytes_bf16,
                "seconds": seconds,
            }
        )
    return records

