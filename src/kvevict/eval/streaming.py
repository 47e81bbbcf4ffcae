"""Streaming perplexity (StreamingLLM's protocol), many policies in one batch.

Every token after the first is predicted from what the cache kept of everything before
it. The first `budget` tokens are prefilled `prefill_piece(chunk)` tokens per forward:
nothing is evicted before the cache is full, so any cut is exactly what token-by-token
feeding would give, and pieces keep the prefill's activations to one chunk's (a budget
of 4,096 read in one forward held 4,096 × hidden floats per activation). After that the
stream is read `chunk` tokens per forward, and inside every layer each token
sees exactly what token-by-token feeding would have kept at its step (the cache's
`per_token` mode, `cache/replay/chunk.py`): the same numbers as one token per forward
(`chunk=1`, the reference path), with the weights and MLPs paid once per chunk.

All policies at one budget run as rows of one batch (the weights are read once per
forward for all of them). The full cache runs in lockstep as a batch of its own, so
fidelity (KL to the full cache, top-1 agreement) is measured on exactly the same tokens
from the same chunked pass, in sub-blocks, without storing any distribution.

The engine (`cache/cache.py`, which imports transformers' cache machinery and, with HQQ installed, HQQ
and torch's compiler stack: seconds) is imported where the cache is built, not at the top: a command's
checks before its model load import this module's neighbours and do without it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..cache.observers import KeptTracker, Observer, SinkTracker, held_pinned_lost
from ..defaults import DEFAULT_CHUNK
from ..errors import KvevictError
from ..policies.base import held_per_step
from ..position_modes import DEFAULT_POSITIONS
from ..progress import bars
from .chunks import boundaries, check_chunk, prefill_piece
from .forward import body, log_probs
from .row_result import RowResult
from .sink_loss import sink_loss

if TYPE_CHECKING:
    from ..cache import EvictingCache

# Elements of `[rows, tokens, vocab]` log-probabilities held at once: NLL and KL are
# computed in sub-blocks of predictions so a long chunk never holds more.
LOGIT_ELEMENTS = 1 << 25


def _validate(tokens: torch.Tensor, model) -> torch.Tensor:
    """The stream as ids on the model's device (the targets are compared with its log-probabilities
    there; the per-token results stay on the CPU, each block copied in)."""
    if tokens.dim() != 1:
        raise KvevictError("streaming perplexity takes one token stream, a 1-D tensor of ids")
    if tokens.numel() < 2:
        raise KvevictError(f"need at least 2 tokens to score a prediction, got {tokens.numel()}")
    return tokens.long().to(model.get_input_embeddings().weight.device)


class _Lane:
    """One batch (a cache and its rows) advancing through the stream."""

    def __init__(self, model, cache: EvictingCache, rows: int) -> None:
        self.model, self.cache, self.rows = model, cache, rows
        self.seconds = 0.0

    def forward(self, chunk: torch.Tensor) -> torch.Tensor:
        """Feed `chunk` (`[q]` tokens); final hidden states `[1 or rows, q, H]`."""
        t0 = time.perf_counter()
        # Until the first eviction every row holds the same tokens: feed one row for all
        # (not for a chunk that will evict inside itself: its rows diverge there).
        budget = self.cache.budget
        fits = budget is None or self.cache.fits(chunk.numel())
        shared = self.rows > 1 and self.cache.shares_rows and fits
        ids = chunk.unsqueeze(0).expand(1 if shared else self.rows, -1)
        hidden = body(self.model, ids, self.cache)
        self.seconds += time.perf_counter() - t0
        return hidden


def blocks(q: int, rows: int, vocab: int) -> list[tuple[int, int]]:
    """`(lo, hi)` sub-blocks of `q` predictions whose `[rows, hi - lo, vocab]` stays under the cap."""
    width = max(1, LOGIT_ELEMENTS // max(1, rows * vocab))
    return [(lo, min(q, lo + width)) for lo in range(0, q, width)]


@dataclass
class Reference:
    """The full cache over a stream: its row, and its final hidden states `[T, H]`.

    Hidden states, not distributions: `[T, H]` is tens of megabytes where `[T, vocab]`
    would be gigabytes, and the LM head turns any block of them into log-probabilities
    when a comparison needs it (KL and top-1 of the policy rows, the recompute oracle).
    """

    result: RowResult
    hidden: torch.Tensor
    model: object = field(repr=False, default=None)

    def log_probs(self, start: int, stop: int) -> torch.Tensor:
        """`[stop - start, vocab]` next-token log-probabilities of predictions start..stop-1."""
        return log_probs(self.model, self.hidden[start:stop])

    def at(self, predictions: torch.Tensor) -> torch.Tensor:
        """`[k, vocab]` log-probabilities at prediction indices `predictions` `[k]`."""
        return log_probs(self.model, self.hidden[predictions])


# Tokens per forward of the full-cache reference (it never evicts: any chunk is exact).
REFERENCE_CHUNK = 512


def full_reference(model, tokens: torch.Tensor, progress=True, label: str = "stream") -> Reference:
    """The full cache over `tokens`: chunks through a full cache are exactly a
    full-sequence forward, at prefill speed."""
    tokens = _validate(tokens, model)
    targets = tokens[1:]
    steps = targets.numel()
    vocab = model.get_output_embeddings().weight.shape[0]
    from ..cache.cache import EvictingCache  # here, not at the top (module docstring)

    kept = KeptTracker()
    lane = _Lane(model, EvictingCache(model, "full", budget=None, observers=[kept]), 1)
    hidden = []
    with torch.inference_mode(), bars(progress) as bar:
        task = bar.add_task(f"{label}: full-cache reference", total=tokens.numel())
        for start, stop in boundaries(tokens.numel(), 0, REFERENCE_CHUNK)[1:]:
            hidden.append(lane.forward(tokens[start:stop])[0])
            bar.advance(task, stop - start)
        bar.remove_task(task)
        reference = Reference(None, torch.cat(hidden)[:steps], model)
        nll = torch.zeros(steps)
        for lo, hi in blocks(steps, 1, vocab):
            nll[lo:hi] = -reference.log_probs(lo, hi).gather(-1, targets[lo:hi, None])[:, 0]
    reference.result = RowResult(
        policy="full", budget=None, positions=DEFAULT_POSITIONS, nll=nll,
        kl=torch.zeros(steps), agree=torch.ones(steps, dtype=torch.bool),
        max_kept=kept.most, mean_kept=(steps + 2) / 2, seconds=lane.seconds,  # holds 1, 2, ... T tokens
    )
    return reference


def compare(
    model,
    tokens: torch.Tensor,
    policies: Sequence[str],
    budget: int,
    positions: str = DEFAULT_POSITIONS,
    reference: bool | Reference = True,
    progress=True,
    label: str = "stream",
    on_step: Callable[[int], None] | None = None,
    chunk: int = DEFAULT_CHUNK,
    observers: Sequence[Observer] = (),
) -> tuple[list[RowResult], RowResult | None]:
    """Streaming NLL of every policy (rows of one batch) and of the full cache.

    Returns (one RowResult per policy, the full cache's RowResult or None). With
    `reference` (True, or a `Reference` computed once for several calls), each policy
    row also gets per-token KL(full || policy) and top-1 agreement with the full cache,
    computed block by block as the rows are scored. `chunk` tokens are read per forward
    after the prefill (1: one token per forward, the reference path). `progress` is a
    bool or an existing rich Progress to add a bar to. `observers` are attached to the
    cache beside the ones this protocol uses (the llama.cpp check records shift points).
    """
    tokens = _validate(tokens, model)
    chunk = check_chunk(chunk)
    rows = len(policies)
    from ..cache.cache import EvictingCache  # here, not at the top (module docstring)

    with torch.inference_mode():
        kept, sinks = KeptTracker(), SinkTracker()
        cache = EvictingCache(
            model, list(policies), budget=budget, positions=positions, observers=[kept, sinks, *observers],
            per_token=True,
        )
        lane = _Lane(model, cache, rows)
        budget = cache.budget  # None when every row is the full cache
        if isinstance(reference, Reference):
            full = reference
        else:
            full = full_reference(model, tokens, progress, label) if reference else None
        scores = _Scores(rows, tokens.numel() - 1, model.get_output_embeddings().weight.shape[0])
        prefill = tokens.numel() if budget is None else min(budget, tokens.numel())
        how = ""
        if not cache.chunk_exact:  # a residual counted at each forward's end: only single tokens read as decode
            prefill, chunk, how = 1, 1, ", token by token for the storage's residual"
        with bars(progress) as bar:
            task = bar.add_task(f"{label} (budget {budget}, {positions}{how})", total=tokens.numel())
            for start, stop in boundaries(tokens.numel(), prefill, chunk, piece=prefill_piece(chunk)):
                hidden = lane.forward(tokens[start:stop])
                t0 = time.perf_counter()
                scores.add(model, hidden, tokens[1:], start, stop, full)
                lane.seconds += time.perf_counter() - t0
                bar.advance(task, stop - start)
                if on_step is not None:
                    on_step(stop)
            bar.remove_task(task)
        results = _row_results(lane, kept, scores, full, budget, positions, tokens.numel())
        return results, (full.result if full is not None else None)


class _Scores:
    """What `compare` measures per prediction, each `[rows, T-1]`, filled block by block as the stream is
    read, so that no `[rows, T, vocab]` distribution is ever held."""

    def __init__(self, rows: int, steps: int, vocab: int) -> None:
        self.nll, self.kl = torch.zeros(rows, steps), torch.zeros(rows, steps)
        self.agree, self.hit = torch.zeros(rows, steps, dtype=torch.bool), torch.zeros(rows, steps, dtype=torch.bool)
        self.vocab = vocab

    def add(self, model, hidden: torch.Tensor, targets: torch.Tensor, start: int, stop: int,
            full: Reference | None) -> None:
        """Score the predictions made from stream positions start..stop-1, whose final hidden states are
        `hidden` `[1 or rows, stop - start, H]` (one row stands for all while they hold the same tokens);
        `targets` `[T-1]`. KL and agreement need the full cache's `full`, read block by block beside them."""
        rows, steps = self.nll.shape
        n_targets = max(0, min(stop, steps) - start)
        for lo, hi in blocks(n_targets, rows + 1, self.vocab):
            at = slice(start + lo, start + hi)
            tgt = targets[at]
            lp = log_probs(model, hidden[:, lo:hi]).expand(rows, -1, -1)
            self.nll[:, at] = -lp.gather(-1, tgt.view(1, -1, 1).expand(rows, -1, 1))[..., 0]
            top = lp.argmax(-1)  # [rows, k]
            self.hit[:, at] = top == tgt
            if full is not None:
                ref = full.log_probs(at.start, at.stop)[None]  # [1, k, vocab]
                self.kl[:, at] = (ref.exp() * (ref - lp)).sum(-1)
                self.agree[:, at] = top == ref.argmax(-1)


def _row_results(lane: _Lane, kept: KeptTracker, scores: _Scores, full: Reference | None, budget: int | None,
                 positions: str, length: int) -> list[RowResult]:
    """One RowResult per policy row of `lane` after its `length`-token stream: the scores, and what the cache
    held and lost by the end (token 0 per layer and head, pinned entries, bytes per row)."""
    cache, rows = lane.cache, lane.rows
    lost_at = cache.sink_lost_at()  # [layers, rows, heads]
    windows = cache.sliding_windows()  # a sliding layer is bounded by the model's window, not the budget
    sliding = [w is not None for w in windows]
    window = next((w for w in windows if w is not None), None)
    grids = [[None if slides else at[row].tolist() for slides, at in zip(sliding, lost_at)] for row in range(rows)]
    pinned_lost = held_pinned_lost(cache.kept_positions(), [p.pinned for p in cache.row_policies()])
    per_row, per_head = _row_memory(cache, lane.model.dtype, rows)
    return [
        RowResult(
            policy=policy.spec(), budget=budget, positions=positions, nll=scores.nll[row].clone(),
            kl=scores.kl[row].clone() if full is not None else None,
            agree=scores.agree[row].clone() if full is not None else None,
            hit=scores.hit[row].clone(), max_kept=kept.most,
            mean_kept=sum(held_per_step(policy, budget, length)) / length,
            pinned_sink_evicted=bool(pinned_lost[row]), first_token_evicted=bool((lost_at[:, row] >= 0).any()),
            sink_loss=sink_loss(grids[row]).share or 0.0, sink_lost_at=grids[row],
            sliding_window=window, seconds=lane.seconds,
            memory=per_row if per_head is None else {**per_row, "held_per_head": [lay[row] for lay in per_head]},
            layer_budgets=cache.layer_budgets() if policy.varies_by_layer else None,
        )
        for row, policy in enumerate(cache.row_policies())
    ]


def _row_memory(cache: EvictingCache, dtype: torch.dtype, rows: int) -> tuple[dict, list | None]:
    """(the bytes and entries one row holds, the same for every row; adakv's per layer `[B][H_kv]` entries
    each head holds, or None): bytes counted from the tensors the cache keeps, split evenly over its rows."""
    memory = cache.memory()
    per_row = {
        "held": memory.held, "kv_bytes": memory.kv_bytes // rows, "full_kv_bytes": memory.full_kv_bytes // rows,
        # the same at the deployment dtype: every float at 2 bytes (a full cache holds floats alone)
        "kv_bytes_bf16": memory.kv_bytes_bf16 // rows,
        "full_kv_bytes_bf16": memory.full_kv_bytes * 2 // dtype.itemsize // rows,
    }
    return per_row, memory.per_head


def streaming_ppl(
    model,
    tokens: torch.Tensor,
    policy: str = "streamingllm",
    budget: int = 256,
    positions: str = DEFAULT_POSITIONS,
    progress: bool = True,
    chunk: int = DEFAULT_CHUNK,
) -> RowResult:
    """Streaming perplexity of one policy (the library form of `kvevict ppl`)."""
    rows, _ = compare(model, tokens, [policy], budget, positions, reference=False, progress=progress, chunk=chunk)
    return rows[0]
