"""Answering a RULER prompt under a protocol, with the policies as rows of one batch, at several budgets.

The protocols themselves are objects (`protocol_kinds/`: `agnostic`, `aware`, `stream`,
`multi` in its forms `requests`, `turns`, `aware-requests`), each saying what it reads
before the first question and how it asks each question; this module runs them and
never asks which one it holds.

The context prefill is computed once for all the policy rows of a batch: one row is
fed and stands for all (`EvictingCache.shares_rows`), each row's policy then keeps its
own entries. The full cache is the reference, one row, computed once per sample and
shared by every budget and protocol (it evicts nothing, so `agnostic`, `aware` and
`stream` are one computation for it).

Answers are greedy and stop at the end of the turn or after the task's answer length
(RULER's `tokens_to_generate`: RULER lets the model run that long and scores it all), and
an answer to a question with one reference (a needle's value, a QA answer) also at the end
of its first line (`Protocol.one_line`). A list (niah_multivalue, niah_multiquery, vt, cwe, fwe)
is read whole: models write one item a line (SmolLM2 answers ":" and then the values),
and the first line alone would score nothing. A row that finished is fed its
end-of-turn token while the others finish, so the batch stays rectangular; in `turns`
those repeats stay in its dialogue.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from ...defaults import DEFAULT_CHUNK
from ...errors import KvevictError
from ...policies import is_full_cache, parse_policy
from ...position_modes import DEFAULT_POSITIONS
from ..compress import Compressed, greedy
from ..prompts import stop_ids
from ..reconstruction import KeptScores
from .protocol_kinds.base import Asking, Protocol
from .protocol_kinds.registry import check_protocol, get_protocol
from .reading import compress_at, prefill, snapshot, whole
from .sample import Prompt

__all__ = ["Answer", "answer", "answer_budgets", "check_aware", "check_protocol", "compress_at", "decode",
           "full_shares_prefill", "prefill", "shares_prefill", "snapshot", "whole"]


def check_aware(specs: Sequence[str], protocol: str = "aware", form: str = "requests") -> None:
    """A question compressed with the context only for policies that rank by attention (see
    `protocol_kinds/aware.py`): `aware`, and `multi --form aware-requests`."""
    what = get_protocol(protocol, form).described
    for spec in specs:
        if is_full_cache(spec):
            continue
        if not parse_policy(spec).needs_attention:
            raise KvevictError(
                f"{what} is meaningless for '{spec}': it keeps entries by position or key alone, so the "
                "question would only take budget, not guide what is kept; run it under agnostic or stream "
                f"(or multi --form requests), or drop it from --policies for this protocol ({what} runs h2o, "
                "snapkv, tova, pyramidkv, adakv:...)"
            )


@dataclass
class Answer:
    """One row's answer to one question."""

    policy: str
    question: int
    tokens: list[int]
    text: str
    kept: int
    seconds: float
    kv_bytes: int | None = None  # what the row's cache held once the context was compressed (`Compressed.measure`)
    kv_bytes_bf16: int | None = None


def _line_done(text: str) -> bool:
    """The answer's first line is complete: a newline after some text."""
    body_text = text.lstrip()
    return "\n" in body_text


def decode(model, tokenizer, state: Compressed, max_new_tokens: int, stops: Sequence[int],
           first_line: bool = True) -> list[list[int]]:
    """Greedy answers, one list of ids per row, each to the end of its first line where the answer is
    one reference (`first_line`, see `Protocol.one_line`), else for the task's whole answer length; a
    finished row is fed the first stop token (its end of turn) while the others go on, or, from a
    cache frozen for good (a state nothing reads after its answer), leaves the batch."""
    def line_done(row: int, ids: list[int]) -> bool:
        return _line_done(tokenizer.decode(ids, skip_special_tokens=True))

    return greedy(model, state, max_new_tokens, stops, line_done if first_line else None,
                  pad=stops[0] if stops else None, release=state.cache.sealed)


def _text(tokenizer, ids: list[int], first_line: bool) -> str:
    text = tokenizer.decode(ids, skip_special_tokens=True).strip()
    return text.split("\n", 1)[0] if first_line else text


def shares_prefill(protocol: str, form: str) -> bool:
    """Whether the protocol compresses a context read in one forward, so that one prefill serves every
    budget (all but `stream` and `multi turns`, which evict as they read)."""
    return get_protocol(protocol, form).shares_prefill


def answer(model, tokenizer, prompt: Prompt, specs: list[str], entries: int | None, protocol: str,
           form: str = "requests", positions: str = DEFAULT_POSITIONS, max_new_tokens: int | None = None,
           stream_chunk: int = DEFAULT_CHUNK) -> list[Answer]:
    """Every row's answers to `prompt` under `protocol`: one per row (or per row and question in `multi`)."""
    [answers] = answer_budgets(model, tokenizer, prompt, specs, [entries], protocol, form, positions,
                               max_new_tokens, stream_chunk)
    return answers


def _full_shares(kind: Protocol, specs: Sequence[str]) -> bool:
    """Whether the full cache can be the held-back prefill of a batch of `specs`, left whole: it reads
    what the bounded rows read before their question (not where the rows compress a question with the
    context while the full cache reads the context alone, `reads_question`, nor where nothing is shared,
    `shares_prefill`), and the rows' layers attend as the full cache's do (not a per-head batch, whose
    layers attend by hand)."""
    per_head = any(parse_policy(spec).varies_by_head for spec in specs)
    return kind.shares_prefill and not kind.reads_question and not per_head


def full_shares_prefill(protocol: str, form: str, specs: Sequence[str] = ()) -> bool:
    """`_full_shares` for the protocol `--protocol PROTOCOL --form FORM` names."""
    return _full_shares(get_protocol(protocol, form), specs)
def answer_budgets(model, tokenizer, prompt: Prompt, specs: list[str], budgets: Sequence[int | None],
                   protocol: str, form: str = "requests", positions: str = DEFAULT_POSITIONS,
                   max_new_tokens: int | None = None, stream_chunk: int = DEFAULT_CHUNK,
                   kept: KeptScores | None = None) -> list[list[Answer]]:
    """`answer` at each of `budgets` (entries), one list per budget; `None` is the full cache, whose
    answers are named `full` (the rows' specs are the bounded budgets').

    Where the protocol allows (`Protocol.shares_prefill`) and the cache can hold its eviction back
    (`EvictingCache.can_defer`), the context is read once and a copy of that state is
    compressed at each budget: the same answers as a prefill per budget, one forward
    instead of several. The full cache is that state left whole, one row kept, where it can
    be (`full_shares_prefill`). A budget's `seconds` are
    its own (compression, question, answer) plus an equal share of the prefill. `kept`: where a policy
    scored by reconstruction keeps and finds its scores (`reconstruction.KeptScores`).
    """
    kind = get_protocol(protocol, form)
    kind.check_model(model)
    kind.check_prompt(prompt)
    stops = stop_ids(tokenizer)
    asking = Asking(model, tokenizer, prompt, positions, stream_chunk,
                    partial(_decode_for, model, tokenizer, max_new_tokens or prompt.answer_tokens, stops))
    bounded = [b for b in budgets if b is not None]
    fold = bool(bounded) and None in budgets and _full_shares(kind, specs)
    answers: dict[int, list[Answer]] = {}  # by the budget's index
    if None in budgets and not fold:
        t1 = time.perf_counter()
        answers[budgets.index(None)] = _answers(asking, kind, _read(asking, kind, ["full"], None), t1)
    if not bounded:
        return [answers[i] for i in range(len(budgets))]
    served = [i for i, b in enumerate(budgets) if b is not None or fold]  # what one bounded read may serve
    t0 = time.perf_counter()
    state = _read(asking, kind, specs, bounded[0], defer=kind.shares_prefill and len(served) > 1,
                  tokenizer=tokenizer, kept=kept)
    if state.cache.deferred:
        share = (time.perf_counter() - t0) / len(served)
        for n, i in enumerate(served):
            t1 = time.perf_counter() - share
            copy_state = snapshot(state) if n < len(served) - 1 else state
            if budgets[i] is None:
                whole(copy_state)
            else:
                compress_at(copy_state, budgets[i] + kind.pinned_span(prompt))
            answers[i] = _answers(asking, kind, copy_state, t1)
    else:  # compressed at the first bounded budget already: every other reads its own prefill
        answers[budgets.index(bounded[0])] = _answers(asking, kind, state, t0)
        for i, entries in enumerate(budgets):
            if i not in answers:
                t1 = time.perf_counter()
                own = _read(asking, kind, ["full"] if entries is None else specs, entries, tokenizer=tokenizer,
                            kept=kept)
                answers[i] = _answers(asking, kind, own, t1)
    return [answers[i] for i in range(len(budgets))]


def _decode_for(model, tokenizer, limit: int, stops: Sequence[int], state: Compressed,
                first_line: bool) -> list[list[int]]:
    """`decode` with a prompt's answer length and stop tokens bound: what a protocol's `Asking.decode` calls."""
    return decode(model, tokenizer, state, limit, stops, first_line)


def _read(asking: Asking, kind: Protocol, specs: list[str], entries: int | None, defer: bool = False,
          tokenizer=None, kept: KeptScores | None = None) -> Compressed:
    """What the protocol reads before its first question is asked (`Protocol.read`)."""
    return kind.read(asking, specs, entries, defer, tokenizer, kept)


def _answers(asking: Asking, kind: Protocol, state: Compressed, t0: float) -> list[Answer]:
    """Every row's answers from the state `_read` left (`t0`: when this budget's work began)."""
    results = kind.answer(asking, state)
    seconds = time.perf_counter() - t0
    prompt, tokenizer = asking.prompt, asking.tokenizer
    return [Answer(spec, q, ids, _text(tokenizer, ids, kind.one_line(prompt, q)), kept, seconds, state.kv_bytes,
                   state.kv_bytes_bf16)
            for q, rows, kept in results for spec, ids in zip(state.policies, rows, strict=True)]
