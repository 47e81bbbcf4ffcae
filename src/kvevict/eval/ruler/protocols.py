"""The four ways a RULER prompt meets a bounded cache, with the policies as rows of one batch.

* `agnostic` (kvpress's, the default): the context is compressed in one forward, the
  cache frozen, then the question is read and the answer decoded (the question is not
  known when the context is compressed: what a reused prefix cache faces).
* `aware` (SnapKV's own setting): everything but the prompt's last token is compressed,
  question included, so a policy ranking by attention sees the question. Only policies
  whose kept set depends on attention may run it (`check_aware`): for the others
  (window, streamingllm, knorm, keydiff, random) it would only spend budget on the
  question's tokens, and a table would show their `aware` row beside SnapKV's as if
  the question had guided them. They are refused with that reason.
* `stream` (StreamingLLM's, H2O's): the budget holds from the first token: the context
  is read in chunks, each token seeing what token-by-token eviction would have kept
  (the cache's `per_token` replay, as in `eval/streaming.py`), and the question and the
  answer are read evicting too.
* `multi`: one compressed context, several questions, each needing another key.
  `requests`: every question starts from the same compressed context (a copy of the
  frozen state); `turns`: a dialogue, each question after the previous answer, the
  budget enforced throughout (the cache is never frozen); `aware-requests` (SCBench's
  case): the first question (but its last token) is read after the context and the
  context compressed with it, the question pinned whole beside the budget
  (`policies/span.py`); the first request reads on from there, and every later one starts
  from the compressed context with the first question taken back out
  (`EvictingCache.crop`), as a prefix cache holding the context would serve it.
  What a query-aware policy kept for the first question is all the later ones get; the
  budget is a share of the context, as in `requests`. Like `aware`, it runs only
  policies that rank by attention, and not on a model with sliding-window layers
  (`check_model_form`).

The context prefill is computed once for all the policy rows of a batch: one row is
fed and stands for all (`EvictingCache.shares_rows`), each row's policy then keeps its
own entries. The full cache is the reference, one row, computed once per sample and
shared by every budget and protocol (it evicts nothing, so `agnostic`, `aware` and
`stream` are one computation for it).

Answers are greedy and stop at the end of the turn or after the task's answer length
(RULER's `tokens_to_generate`: RULER lets the model run that long and scores it all), and
an answer to a question with one reference (a needle's value, a QA answer) also at the end
of its first line (`one_line`). A list (niah_multivalue, niah_multiquery, vt, cwe, fwe)
is read whole: models write one item a line (SmolLM2 answers ":" and then the values),
and the first line alone would score nothing. A row that finished is fed its
end-of-turn token while the others finish, so the batch stays rectangular; in `turns`
those repeats stay in its dialogue.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ...cache import EvictingCache
from ...cache.model_info import layer_kinds, text_config
from ...defaults import DEFAULT_CHUNK
from ...errors import KvevictError
from ...policies import is_full_cache, parse_policy
from ...policies.span import pin_span
from ...position_modes import DEFAULT_POSITIONS
from ..compress import Compressed, greedy
from ..forward import body
from ..prompts import stop_ids
from ..reconstruction import KeptScores, reconstruct, reconstructing_policy
from .sample import Prompt

PROTOCOLS = ("agnostic", "aware", "stream", "multi")
FORMS = ("requests", "turns", "aware-requests")


def check_protocol(protocol: str, form: str) -> None:
    if protocol not in PROTOCOLS:
        raise KvevictError(f"unknown protocol '{protocol}': use one of {', '.join(PROTOCOLS)}")
    if form not in FORMS:
        raise KvevictError(f"unknown multi form '{form}': use {', '.join(FORMS)}")


def reads_question(protocol: str, form: str) -> bool:
    """Whether a question is compressed with the context: `aware`, and `multi` in its `aware-requests` form."""
    return protocol == "aware" or (protocol == "multi" and form == "aware-requests")


def check_aware(specs: Sequence[str], protocol: str = "aware", form: str = "requests") -> None:
    """A question compressed with the context only for policies that rank by attention (see the module's
    docstring): `aware`, and `multi --form aware-requests`."""
    what = "protocol aware" if protocol == "aware" else f"protocol {protocol} --form {form}"
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


def check_model_form(model, protocol: str, form: str) -> None:
    """`multi --form aware-requests` takes the first question back out of the compressed state
    (`EvictingCache.crop`); a sliding-window layer holds only the model's last `W - 1` tokens,
    so reading the question pushed context out of it that the later requests would have seen."""
    if not (protocol == "multi" and form == "aware-requests"):
        return
    text = text_config(model)
    if "sliding_attention" in layer_kinds(text, type(model).__name__):  # the kinds the cache gives its layers
        raise KvevictError(
            f"protocol multi --form aware-requests cannot run on {type(model).__name__}: its sliding-window layers "
            f"keep only the last {text.sliding_window - 1} tokens, so the first question would push out context "
            "the later requests need; use --form requests or turns, or a model without sliding-window layers"
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


def prefill(model, ids: torch.Tensor, specs: list[str], entries: int | None, positions: str,
            stream: bool = False, chunk: int = DEFAULT_CHUNK, defer: bool = False, tokenizer=None,
            kept: KeptScores | None = None) -> Compressed:
    """Read `ids` `[T]` into one cache whose rows are `specs`, the shared prefix fed once.

    Without `stream`, one forward reads all of it and each row's policy then compresses
    to `entries` (the SnapKV/kvpress protocol). With `stream`, the cache is exact per
    token: the first `entries` tokens go in one forward (nothing is evicted before the
    cache is full), the rest in chunks of `chunk` tokens, every row fed its own copy.
    With `defer` (where the cache can, `EvictingCache.can_defer`), the forward measures
    what the policies need and evicts nothing: `compress_at` then compresses copies of
    the state at any budget (`state.cache.deferred` says whether it did). A policy scored by
    reconstruction (`kvzip`) always holds its prefill back, and the context is reconstructed
    (`tokenizer`: the model's) before any budget compresses it, or scored from `kept` where it holds this
    context's scores (`reconstruction.KeptScores`).
    """
    rows = len(specs)
    with torch.inference_mode():
        cache = EvictingCache(model, specs, budget=entries, positions=positions, per_token=stream)
        scored = entries is not None and reconstructing_policy(cache) is not None
        if scored and (stream or not cache.can_defer):
            raise KvevictError(
                f"'{specs[0]}' scores a context by reconstructing it once it is read, and this protocol evicts as it "
                "reads: run it under agnostic, aware or multi --form requests"
            )
        if (defer or scored) and not stream and entries is not None and cache.can_defer:
            cache.defer()
        head = ids.numel() if not stream or entries is None else min(entries, ids.numel())
        hidden = body(model, ids[None, :head].long(), cache)[:, -1]
        if scored:
            reconstruct(model, cache, ids, tokenizer, kept)
            if not defer:
                cache.evict_deferred()
        for start in range(head, ids.numel(), chunk):
            piece = ids[start : start + chunk].long()
            hidden = body(model, piece[None].expand(rows, -1), cache)[:, -1]
    return Compressed(cache, hidden.expand(rows, -1).clone(), ids.numel(), cache.budget,
                      [p.spec() for p in cache.policies]).measure()


def compress_at(state: Compressed, entries: int) -> Compressed:
    """Compress a state `prefill(..., defer=True)` held back to `entries` (in place; returns it)."""
    with torch.inference_mode():
        state.cache.budget = entries
        state.cache.evict_deferred()
    state.budget = state.cache.budget
    return state.measure()


def snapshot(state: Compressed) -> Compressed:
    """An independent copy of a compressed state: its cache copied (`EvictingCache.copy`, which shares
    what is the model's), its hidden state cloned."""
    return replace(state, cache=state.cache.copy(), hidden=state.hidden.clone(), policies=list(state.policies))


def _line_done(text: str) -> bool:
    """The answer's first line is complete: a newline after some text."""
    body_text = text.lstrip()
    return "\n" in body_text


def decode(model, tokenizer, state: Compressed, max_new_tokens: int, stops: Sequence[int],
           first_line: bool = True) -> list[list[int]]:
    """Greedy answers, one list of ids per row, each to the end of its first line where the answer is
    one reference (`first_line`, see `one_line`), else for the task's whole answer length; a
    finished row is fed the first stop token (its end of turn) while the others go on, or, from a
    cache frozen for good (a state nothing reads after its answer), leaves the batch."""
    def line_done(row: int, ids: list[int]) -> bool:
        return _line_done(tokenizer.decode(ids, skip_special_tokens=True))

    return greedy(model, state, max_new_tokens, stops, line_done if first_line else None,
                  pad=stops[0] if stops else None, release=state.cache.sealed)


def one_line(prompt: Prompt, protocol: str, question: int) -> bool:
    """Whether an answer is read to the end of its first line: when its question has one reference.
    A list (several values, keys, variables or words) may run over several lines, one item a line,
    so it is read for the task's whole answer length, as RULER reads every answer."""
    asked = prompt.sample.per_key[question] if protocol == "multi" else prompt.sample.question
    return len(asked.answers) == 1


def _text(tokenizer, ids: list[int], first_line: bool) -> str:
    text = tokenizer.decode(ids, skip_special_tokens=True).strip()
    return text.split("\n", 1)[0] if first_line else text


def shares_prefill(protocol: str, form: str) -> bool:
    """Whether the protocol compresses a context read in one forward, so that one prefill serves every
    budget (all but `stream` and `multi turns`, which evict as they read)."""
    return protocol != "stream" and not (protocol == "multi" and form == "turns")


def answer(model, tokenizer, prompt: Prompt, specs: list[str], entries: int | None, protocol: str,
           form: str = "requests", positions: str = DEFAULT_POSITIONS, max_new_tokens: int | None = None,
           stream_chunk: int = DEFAULT_CHUNK) -> list[Answer]:
    """Every row's answers to `prompt` under `protocol`: one per row (or per row and question in `multi`)."""
    [answers] = answer_budgets(model, tokenizer, prompt, specs, [entries], protocol, form, positions,
                               max_new_tokens, stream_chunk)
    return answers


def full_shares_prefill(protocol: str, form: str, specs: Sequence[str] = ()) -> bool:
    """Whether the full cache can be the held-back prefill of a batch of `specs`, left whole: it reads
    what the bounded rows read before their question (not under `aware` or `multi aware-requests`,
    whose rows compress the question with the context while the full cache reads the context alone,
    nor where nothing is shared, `shares_prefill`), and the rows' layers attend as the full cache's
    do (not a per-head batch, whose layers attend by hand)."""
    compresses_question = protocol == "aware" or (protocol == "multi" and form == "aware-requests")
    per_head = any(parse_policy(spec).varies_by_head for spec in specs)
    return shares_prefill(protocol, form) and not compresses_question and not per_head


def answer_budgets(model, tokenizer, prompt: Prompt, specs: list[str], budgets: Sequence[int | None],
                   protocol: str, form: str = "requests", positions: str = DEFAULT_POSITIONS,
                   max_new_tokens: int | None = None, stream_chunk: int = DEFAULT_CHUNK,
                   kept: KeptScores | None = None) -> list[list[Answer]]:
    """`answer` at each of `budgets` (entries), one list per budget; `None` is the full cache, whose
    answers are named `full` (the rows' specs are the bounded budgets').

    Where the protocol allows (`shares_prefill`) and the cache can hold its eviction back
    (`EvictingCache.can_defer`), the context is read once and a copy of that state is
    compressed at each budget: the same answers as a prefill per budget, one forward
    instead of several. The full cache is that state left whole, one row kept, where it can
    be (`full_shares_prefill`). A budget's `seconds` are
    its own (compression, question, answer) plus an equal share of the prefill. `kept`: where a policy
    scored by reconstruction keeps and finds its scores (`reconstruction.KeptScores`).
    """
    check_protocol(protocol, form)
    check_model_form(model, protocol, form)
    if protocol == "multi" and not prompt.per_key:
        raise KvevictError(f"protocol multi needs a task with several keys in one context, not "
                           f"{prompt.sample.task}: use niah_multikey_1/2/3 or niah_multiquery")
    limit = max_new_tokens or prompt.answer_tokens
    stops = stop_ids(tokenizer)
    bounded = [b for b in budgets if b is not None]
    fold = bool(bounded) and None in budgets and full_shares_prefill(protocol, form, specs)
    answers: dict[int, list[Answer]] = {}  # by the budget's index
    if None in budgets and not fold:
        t1 = time.perf_counter()
        full = _read(model, prompt, ["full"], None, protocol, form, positions, stream_chunk)
        answers[budgets.index(None)] = _answers(model, tokenizer, prompt, full, protocol, form, limit, stops, t1,
                                                stream_chunk)
    if bounded:
        served = [i for i, b in enumerate(budgets) if b is not None or fold]  # what one bounded read may serve
        t0 = time.perf_counter()
        state = _read(model, prompt, specs, bounded[0], protocol, form, positions, stream_chunk,
                      defer=shares_prefill(protocol, form) and len(served) > 1, tokenizer=tokenizer, kept=kept)
        if state.cache.deferred:
            share = (time.perf_counter() - t0) / len(served)
            for n, i in enumerate(served):
                t1 = time.perf_counter() - share
                copy_state = snapshot(state) if n < len(served) - 1 else state
                if budgets[i] is None:
                    whole(copy_state)
                else:
                    compress_at(copy_state, budgets[i] + pinned_span(prompt, protocol, form))
                answers[i] = _answers(model, tokenizer, prompt, copy_state, protocol, form, limit, stops, t1)
        else:  # compressed at the first bounded budget already: every other reads its own prefill
            answers[budgets.index(bounded[0])] = _answers(model, tokenizer, prompt, state, protocol, form, limit,
                                                          stops, t0, stream_chunk)
            for i, entries in enumerate(budgets):
                if i not in answers:
                    t1 = time.perf_counter()
                    own = _read(model, prompt, ["full"] if entries is None else specs, entries, protocol, form,
                                positions, stream_chunk, tokenizer=tokenizer, kept=kept)
                    answers[i] = _answers(model, tokenizer, prompt, own, protocol, form, limit, stops, t1,
                                          stream_chunk)
    return [answers[i] for i in range(len(budgets))]


def whole(state: Compressed) -> Compressed:
    """A state `prefill(..., defer=True)` held back, left whole: the full cache, one row (in place).

    Nothing was evicted, and every row holds the same entries, so row 0 is the full
    cache's state: the same keys and values, the same next hidden state.
    """
    with torch.inference_mode():
        state.cache.budget = None
        state.cache.evict_deferred()  # at no budget: nothing goes, the layers stop holding back
        state.cache.freeze(final=True)
        state.keep_rows([0])
    state.policies, state.budget = ["full"], None
    return state.measure()


def _read(model, prompt: Prompt, specs: list[str], entries: int | None, protocol: str, form: str,
          positions: str, stream_chunk: int, defer: bool = False, tokenizer=None,
          kept: KeptScores | None = None) -> Compressed:
    """What the protocol reads before its first question is asked: the context (with the question, or
    the first question but its last token, where the protocol compresses it too)."""
    bounded = entries is not None
    if protocol == "aware" and bounded:
        return prefill(model, prompt.ids[:-1], specs, entries, positions, defer=defer, tokenizer=tokenizer, kept=kept)
    if protocol == "stream" and bounded:
        return prefill(model, prompt.context, specs, entries, positions, stream=True, chunk=stream_chunk)
    span = pinned_span(prompt, protocol, form)
    if span:  # multi aware-requests: the first question but its last token, pinned whole beside the budget
        start = prompt.context.numel()
        rows = [pin_span(spec, span, start) for spec in specs] if bounded else specs
        return prefill(model, torch.cat([prompt.context, prompt.per_key[0][:-1]]), rows,
                       None if entries is None else entries + span, positions, defer=defer, tokenizer=tokenizer,
                       kept=kept)
    return prefill(model, prompt.context, specs, entries, positions, defer=defer, tokenizer=tokenizer, kept=kept)


def pinned_span(prompt: Prompt, protocol: str, form: str) -> int:
    """Tokens read after the context and kept whole beside the budget, to be taken back out for the
    later requests: the first question but its last token under `multi --form aware-requests`, else 0."""
    return prompt.per_key[0].numel() - 1 if protocol == "multi" and form == "aware-requests" else 0


def _answers(model, tokenizer, prompt: Prompt, state: Compressed, protocol: str, form: str, limit: int,
             stops: Sequence[int], t0: float, stream_chunk: int = DEFAULT_CHUNK) -> list[Answer]:
    """Every row's answers from the state `_read` left (`t0`: when this budget's work began)."""
    bounded = state.budget is not None
    results: list[tuple[int, list[list[int]], int]] = []
    if protocol == "aware" and bounded:
        state.cache.freeze(final=True)
        state.feed(model, prompt.ids[-1:])
        results.append((0, decode(model, tokenizer, state, limit, stops, one_line(prompt, protocol, 0)), state.kept))
    elif protocol == "stream" and bounded:
        with torch.inference_mode():
            for start in range(0, prompt.question.numel(), stream_chunk):
                piece = prompt.question[start : start + stream_chunk].long()
                state.hidden = body(model, piece[None].expand(state.rows, -1), state.cache)[:, -1]
        results.append((0, decode(model, tokenizer, state, limit, stops, one_line(prompt, protocol, 0)), state.kept))
    elif protocol == "multi":
        if form == "aware-requests":
            state.cache.freeze(final=True)
            span = pinned_span(prompt, protocol, form)
            kept = state.kept - span  # the context's entries: the question is the request's, as in `requests`
            later = snapshot(state) if len(prompt.per_key) > 1 else None
            state.feed(model, prompt.per_key[0][-1:])
            results.append((0, decode(model, tokenizer, state, limit, stops, one_line(prompt, protocol, 0)), kept))
            for q in range(1, len(prompt.per_key)):
                copy_state = snapshot(later) if q < len(prompt.per_key) - 1 else later
                copy_state.cache.crop(-span)  # the first question out: the context as it compressed it
                copy_state.feed(model, prompt.per_key[q])
                results.append((q, decode(model, tokenizer, copy_state, limit, stops, one_line(prompt, protocol, q)),
                                kept))
        elif form == "requests":
            state.cache.freeze(final=True)
            for q, ids in enumerate(prompt.per_key):
                copy_state = snapshot(state) if q < len(prompt.per_key) - 1 else state
                copy_state.feed(model, ids)
                results.append((q, decode(model, tokenizer, copy_state, limit, stops, one_line(prompt, protocol, q)),
                                state.kept))
        else:
            for q, ids in enumerate([prompt.per_key[0], *prompt.follow_ups[1:]]):
                state.feed(model, ids)
                results.append((q, decode(model, tokenizer, state, limit, stops, one_line(prompt, protocol, q)),
                                state.kept))
    else:  # agnostic, and the full cache of agnostic / aware / stream
        state.cache.freeze(final=True)
        state.feed(model, prompt.question)
        results.append((0, decode(model, tokenizer, state, limit, stops, one_line(prompt, protocol, 0)), state.kept))
    seconds = time.perf_counter() - t0
    return [Answer(spec, q, ids, _text(tokenizer, ids, one_line(prompt, protocol, q)), kept, seconds, state.kv_bytes,
                   state.kv_bytes_bf16)
            for q, rows, kept in results for spec, ids in zip(state.policies, rows, strict=True)]
