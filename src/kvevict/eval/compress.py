"""Context compression (the SnapKV / kvpress protocol) as a library function.

Prefill a context through an `EvictingCache`, in one forward or in chunks (`chunk`: the same
kept entries, one chunk's activations alive at a time): every query sees the whole context
before it, and the policy then keeps `budget` entries per layer and KV head. The cache is
frozen afterwards, so whatever follows (a question, the answer being generated, a
continuation being scored) is appended without further eviction. In
`original` position mode later tokens continue from the original context length, as
kvpress and SnapKV do; in `cache` mode they continue from the number of entries kept.

Several policies run as rows of one batch at one budget. A budget is a number of
entries or a share of the context (`"25%"`), resolved against the context length.
`compress_prompt` is the form the tasks use: everything but the prompt's last token is
compressed, so every generated token is computed from what the policy kept.

A policy scored by reconstruction (`kvzip`) needs the model's `tokenizer`: the prefill is held
back, the context reconstructed (`reconstruction.reconstruct`), then compressed.

The engine (`cache/cache.py`, which imports transformers' cache machinery and, with HQQ installed, HQQ
and torch's compiler stack: seconds) is imported where the cache is built, not at the top: a command's
checks before its model load import this module's neighbours and do without it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from ..errors import KvevictError
from ..policies import Policy
from ..policies.budget import Budget, resolve_budget
from ..position_modes import DEFAULT_POSITIONS
from .chunks import check_chunk
from .forward import body, log_probs, logits
from .reconstruction import reconstruct, reconstructing_policy, repeat_room

if TYPE_CHECKING:
    from ..cache import EvictingCache


@dataclass
class Compressed:
    """A compressed context ready to be continued: its cache and the last hidden state.

    `hidden` `[B, H]` is the final hidden state of the last token fed, i.e. what predicts
    the next token. `kept` is the largest number of entries any layer holds right after
    compression (at most the budget); `kv_bytes` and `kv_bytes_bf16` what one row's cache holds
    then, in bytes, as held and with every float at 2 bytes (`measure`).
    """

    cache: EvictingCache
    hidden: torch.Tensor
    context_length: int
    budget: int | None
    policies: list[str]
    kept: int = 0
    kv_bytes: int | None = None
    kv_bytes_bf16: int | None = None

    def measure(self) -> Compressed:
        """Read what the cache holds now (`kept`, and the bytes per row); returns the state.

        The bytes are the cache's own count of the tensors it keeps (`EvictingCache.memory`: keys and values, or a
        quantized form's codes, scales, zero points and residual), summed over the batch and divided by its rows:
        the rows of one state hold one budget, so each row's share is what one sequence takes."""
        memory = self.cache.memory()
        self.kept = self.cache.held_entries()
        self.kv_bytes = round(memory.kv_bytes / self.rows)
        self.kv_bytes_bf16 = round(memory.kv_bytes_bf16 / self.rows)
        return self

    @property
    def rows(self) -> int:
        return self.hidden.shape[0]

    def next_logits(self, model) -> torch.Tensor:
        """`[B, vocab]` float32 logits of the next token."""
        with torch.inference_mode():
            return logits(model, self.hidden).float()

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only the batch rows `rows` (a cache frozen for good: `EvictingCache.batch_select_indices`)."""
        self.cache.batch_select_indices(rows)
        if len(self.policies) == self.rows:
            self.policies = [self.policies[r] for r in rows]
        self.hidden = self.hidden[rows]

    def feed(self, model, ids: torch.Tensor) -> torch.Tensor:
        """Append `ids` (`[q]` shared by every row, or `[B, q]`) without eviction; returns their hidden states."""
        if ids.dim() == 1:
            ids = ids.unsqueeze(0).expand(self.rows, -1)
        if ids.shape[1] == 0:
            return self.hidden[:, None][:, :0]
        with torch.inference_mode():
            hidden = body(model, ids.long(), self.cache)
        self.hidden = hidden[:, -1]
        return hidden


def compress(
    model,
    context: torch.Tensor,
    policies: str | Policy | Sequence[str | Policy],
    budget: Budget,
    positions: str = DEFAULT_POSITIONS,
    tokenizer=None,
    chunk: int | None = None,
) -> Compressed:
    """Prefill `context` and compress it to `budget`.

    `context` is `[T]` token ids read by every row, or `[B, T]`, one context per row (B
    requests of one length as one batch). `policies` is one spec or one per row. The
    full cache (`"full"`) must run in its own call. `tokenizer`: the model's, for a policy
    scored by reconstruction (`kvzip`), whose context is `[T]` (or `[1, T]`) starting with the chat
    template's opening as kvpress's pipeline frames it.

    `chunk`: the context is read `chunk` tokens per forward into the full cache and compressed once
    after the last (`prefill`): the same kept entries as one forward over it, with the activations of
    one chunk alive at a time instead of the whole context's. None (the default): one forward.
    """
    if context.dim() not in (1, 2) or context.shape[-1] == 0:
        raise KvevictError("compress takes a non-empty context: token ids [T], or [B, T] for one per row")
    if chunk is not None:
        check_chunk(chunk)
    specs = list(policies) if isinstance(policies, (list, tuple)) else [policies]
    if context.dim() == 2 and len(specs) == 1:
        specs = specs * context.shape[0]
    entries = resolve_budget(budget, context.shape[-1])
    from ..cache.cache import EvictingCache  # here, not at the top (module docstring)

    with torch.inference_mode():
        cache = EvictingCache(model, specs, budget=entries, positions=positions)
        ids = context.long().expand(len(specs), -1)
        reconstructing = reconstructing_policy(cache)
        scored = reconstructing is not None
        if scored and context.dim() != 1 and context.shape[0] != 1:
            raise KvevictError("a policy scored by reconstruction (kvzip) compresses one context [T] at a time")
        room = repeat_room(context.reshape(-1), tokenizer, reconstructing) if scored and tokenizer is not None else 0
        hidden = prefill(model, cache, ids[:1] if scored else ids, chunk, room).expand(len(specs), -1, -1)
        if scored:
            reconstruct(model, cache, context.reshape(-1), tokenizer)
        if cache.deferred:
            cache.evict_deferred()
        bound = cache.budget  # None when every row is the full cache
        cache.freeze()
    names = [p.spec() for p in cache.policies]
    return Compressed(cache, hidden[:, -1], context.shape[-1], bound, names).measure()


def prefill(model, cache: EvictingCache, ids: torch.Tensor, chunk: int | None = None, room: int = 0) -> torch.Tensor:
    """Read `ids` `[B, T]` into `cache` for one compression; the final hidden states of the last forward
    `[B, q, H]`. The eviction is held back (`EvictingCache.defer`) where the cache must still score the
    context after it is read (a policy scored by reconstruction) or where it is read in several forwards;
    the caller then evicts (`evict_deferred`).

    In `chunk`s (kvpress #178, vLLM's chunked prefill): the chunks before the last are read as the full
    cache reads them (no budget, so nothing is planned to leave and what a policy measures only where it
    evicts waits: SnapKV's window, TOVA's last query, Expected Attention's queries, which it gathers
    meanwhile, `SlotView.held_back`); H2O's sums take every chunk's queries as one forward's would. The
    last chunk is read at the budget, held back, so each policy measures what it measures over a whole
    prompt. The first chunk is the remainder, so the last is a whole `chunk` (a window of recent queries
    then lies in it wherever it fits). Peak memory: the full cache of `T` tokens (reserved at once,
    `EvictingCache.reserve`) plus one chunk's activations, where one forward holds the whole prompt's
    (`[B, T, H]` per activation, `[B, H_q, T, D]` queries). `room`: tokens reserved beyond the context, for the
    forwards that follow it before the eviction (KVzip's repeat forwards, `reconstruction.repeat_room`), so
    that none of them grows the cache by copying it.
    """
    length = ids.shape[-1]
    if reconstructing_policy(cache) is not None or (chunk is not None and chunk < length):
        cache.defer()
    if chunk is None or chunk >= length:
        return body(model, ids, cache)
    budget = cache.budget
    cache.budget = None
    cache.reserve(length + room)
    try:
        starts = range(length % chunk or chunk, length, chunk)
        body(model, ids[:, : starts[0]], cache)
        for start in starts:
            if start + chunk >= length:
                cache.budget = budget
            hidden = body(model, ids[:, start : start + chunk], cache)
    finally:
        cache.reserve(0)
    return hidden


def compress_prompt(
    model,
    prompt: torch.Tensor,
    policies: str | Policy | Sequence[str | Policy],
    budget: Budget,
    positions: str = DEFAULT_POSITIONS,
    split: int | None = None,
    tokenizer=None,
    chunk: int | None = None,
) -> Compressed:
    """Compress `prompt[:split]`, then read `prompt[split:]` through the compressed cache.

    The default split leaves out the last prompt token, so the first generated token,
    like every later one, is computed from what the policy kept (when the whole prompt
    is compressed, its last position attends over everything before eviction and the
    first answer token would escape the budget). A split at the end of a document
    compresses the document alone and reads the question afterwards (kvpress's
    question-agnostic protocol). `tokenizer`: the model's, for a policy scored by reconstruction
    (`kvzip`, see `compress`); `chunk`: tokens per forward of the compressed part (`compress`).
    """
    if prompt.dim() != 1 or prompt.numel() < 2:
        raise KvevictError("compress_prompt needs a 1-D prompt of at least 2 token ids")
    split = prompt.numel() - 1 if split is None else split
    if not 1 <= split < prompt.numel():
        raise KvevictError(f"split must leave at least one token on each side, got {split} of {prompt.numel()}")
    state = compress(model, prompt[:split], policies, budget, positions, tokenizer, chunk)
    state.feed(model, prompt[split:])
    return state


def continuation_nll(
    model,
    context: torch.Tensor,
    continuation: torch.Tensor,
    policies: str | Policy | Sequence[str | Policy],
    budget: Budget,
    positions: str = DEFAULT_POSITIONS,
    tokenizer=None,
    chunk: int | None = None,
) -> torch.Tensor:
    """`[rows, len(continuation)]` NLL of each continuation token after compressing `context`
    (`tokenizer`: the model's, for a policy scored by reconstruction; `chunk`: tokens per forward of the
    context; see `compress`).

    The first continuation token is predicted from the compression forward itself (as in
    SnapKV, whose last prompt token sees the whole prompt); every later one reads the
    compressed cache plus the continuation before it.
    """
    if continuation.dim() != 1 or continuation.numel() == 0:
        raise KvevictError("continuation_nll needs a non-empty 1-D continuation of token ids")
    state = compress(model, context, policies, budget, positions, tokenizer, chunk)
    with torch.inference_mode():
        first = log_probs(model, state.hidden[:, None])
        rest = state.feed(model, continuation[:-1].long())
        lp = torch.cat([first, log_probs(model, rest)], dim=1) if continuation.numel() > 1 else first
        target = continuation.long().view(1, -1, 1).expand(state.rows, -1, 1)
        return -lp.gather(-1, target)[..., 0]


def greedy(model, state: Compressed, max_new_tokens: int, stop_ids: Sequence[int] = (),
           finished: Callable[[int, list[int]], bool] | None = None, pad: int | None = None,
           release: bool = False) -> list[list[int]]:
    """Greedy decoding from a compressed context, one list of new token ids per row.

    Rows stop independently at a stop token (not included), when `finished(row, ids)`
    says their text is complete (lm-eval's `until` strings), or after `max_new_tokens`; a
    finished row keeps being fed (its own argmax, or `pad` from the step after it
    finished: a dialogue that goes on should hold an end of turn, not babble) so the
    batch stays rectangular, and what it produces is discarded. `generate` is not used
    because the cache already holds the context, and kvevict's cache must see every forward.

    `release` (a cache frozen for good, `EvictingCache.freeze(final=True)`, whose state the
    caller will not use again): once a quarter of the rows still in the batch are done,
    they leave it (`EvictingCache.batch_select_indices`), so the batch no longer decodes at its full
    width for as long as its longest answer. Each row computes what it computes in the
    full batch; only the batch's width changes, which may move the last bits of a matrix
    product (`tests/test_keep_rows.py` holds every row to its policy alone within 1e-4).
    """
    stops = set(int(s) for s in stop_ids)
    out: list[list[int]] = [[] for _ in range(state.rows)]
    done = [False] * state.rows
    live = list(range(state.rows))  # the row of `out` each batch row decodes
    if release:  # a copy of the record, its cache shared: the caller's record keeps its rows' names
        state = replace(state)
    with torch.inference_mode():
        for step in range(max_new_tokens):
            token = state.next_logits(model).argmax(-1)
            for i, value in enumerate(token.tolist()):
                row = live[i]
                if done[row]:
                    if pad is not None:
                        token[i] = pad
                    continue
                if value in stops:
                    done[row] = True
                else:
                    out[row].append(value)
                    done[row] = finished is not None and finished(row, out[row])
            if all(done) or step == max_new_tokens - 1:
                break
            if release:
                running = [i for i, row in enumerate(live) if not done[row]]
                if 4 * (len(live) - len(running)) >= len(live):
                    state.keep_rows(running)
                    token = token[running]
                    live = [live[i] for i in running]
            state.feed(model, token[:, None])
    return out
