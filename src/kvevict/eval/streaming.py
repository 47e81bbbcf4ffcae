"""Streaming perplexity (StreamingLLM's protocol), many policies in one batch.

Every token after the first is predicted from what the cache kept of everything before
it. The first `budget` tokens are prefilled in one forward: nothing is evicted before
the cache is full, so this is exactly what token-by-token feeding would give. After
that, one token per step, evicting whenever the budget overflows.

All policies at one budget run as rows of one batch (the weights are read once per
step for all of them: on a CPU that is the main cost). The full cache runs in lockstep
as a batch of its own, so fidelity (KL to the full cache, top-1 agreement) is measured
on exactly the same tokens without storing any distribution.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..cache import EvictingCache, KeptTracker, SinkTracker
from ..cache.observers import held_pinned_lost, held_sink_loss
from ..errors import KvevictError
from ..progress import bars
from .forward import body, log_probs

# Rows of the prefill scored at once: bounds the `[rows, chunk, vocab]` logits.
PREFILL_CHUNK = 256


@dataclass
class RowResult:
    """The measurements of one policy over one stream."""

    policy: str
    budget: int | None
    positions: str
    nll: torch.Tensor  # [T-1] negative log-likelihood of tokens 1..T-1
    kl: torch.Tensor | None = None  # [T-1] KL(full || policy) per prediction
    agree: torch.Tensor | None = None  # [T-1] top-1 equal to the full cache's
    max_kept: int = 0
    pinned_sink_evicted: bool = False
    first_token_evicted: bool = False
    sink_loss: float = 0.0
    sink_lost_at: list = field(default_factory=list)  # [layer][kv head] tokens seen when token 0 left, -1 never
    seconds: float = 0.0
    scored: torch.Tensor | None = None  # [T-1] which predictions were scored (None: all)
    head: int = 0  # with `scored`: the first `head` predictions are all scored, the rest sampled
    baseline_nll: float | None = None  # the full cache's NLL on the same (sampled) predictions

    def _mean(self, values: torch.Tensor) -> float:
        """Mean over all predictions; for a strided sample, a stratified estimate.

        The head (every prediction scored) counts exactly and the sampled tail's mean
        stands for the whole tail, so a sparse sample is not dominated by the head's
        short-context (high-loss) predictions and stays comparable to full rows.
        """
        values = values.double()
        if self.scored is None:
            return float(values.mean())
        head, tail = values[: self.head], values[self.head :][self.scored[self.head :]]
        if tail.numel() == 0:
            return float(head.mean())
        rest = values.numel() - self.head
        return float((head.sum() + tail.mean() * rest) / values.numel())

    @property
    def n_predictions(self) -> int:
        return int(self.nll.numel() if self.scored is None else self.scored.sum())

    @property
    def nll_mean(self) -> float:
        return self._mean(self.nll)

    @property
    def ppl(self) -> float:
        return math.exp(self.nll_mean)

    def ppl_windows(self, width: int) -> list[dict]:
        """PPL of consecutive windows of predictions, keyed by the window's last target position."""
        out = []
        for start in range(0, self.nll.numel(), width):
            chunk = self.nll[start : start + width].double()
            if self.scored is not None:
                chunk = chunk[self.scored[start : start + width]]
            if chunk.numel():
                end = min(start + width, self.nll.numel())
                out.append({"start": start + 1, "end": end, "ppl": math.exp(float(chunk.mean()))})
        return out

    def summary(self) -> dict:
        data = {
            "policy": self.policy,
            "budget": self.budget,
            "positions": self.positions,
            "n_predictions": self.n_predictions,
            "ppl": self.ppl,
            "nll_mean": self.nll_mean,
            "max_kept": self.max_kept,
            "sink_evicted": self.pinned_sink_evicted,
            "first_token_evicted": self.first_token_evicted,
            "sink_loss": self.sink_loss,
            "seconds": self.seconds,
        }
        if self.baseline_nll is not None:
            data["full_ppl_same_tokens"] = math.exp(self.baseline_nll)
        if self.kl is not None:
            data["kl_to_full"] = self._mean(self.kl)
            data["top1_agreement"] = self._mean(self.agree)
        return data


def _validate(tokens: torch.Tensor) -> torch.Tensor:
    if tokens.dim() != 1:
        raise KvevictError("streaming perplexity takes one token stream, a 1-D tensor of ids")
    if tokens.numel() < 2:
        raise KvevictError(f"need at least 2 tokens to score a prediction, got {tokens.numel()}")
    return tokens.long()


class _Lane:
    """One batch (a cache and its rows) advancing through the stream."""

    def __init__(self, model, cache: EvictingCache, rows: int, steps: int) -> None:
        self.model, self.cache, self.rows = model, cache, rows
        self.nll = torch.zeros(rows, steps)
        self.seconds = 0.0

    def feed(self, chunk: torch.Tensor, start: int, targets: torch.Tensor, sink: Callable | None) -> None:
        """Feed `chunk` (`[q]` tokens at stream offset `start`) and score its predictions."""
        t0 = time.perf_counter()
        # Until the first eviction every row holds the same tokens: feed one row for all.
        shared = self.rows > 1 and self.cache.shares_rows
        ids = chunk.unsqueeze(0).expand(1 if shared else self.rows, -1)
        hidden = body(self.model, ids, self.cache)
        q = chunk.numel()
        for lo in range(0, q, PREFILL_CHUNK):
            hi = min(q, lo + PREFILL_CHUNK)
            n_targets = max(0, min(hi, targets.numel() - start) - lo)
            if n_targets == 0:
                break
            lp = log_probs(self.model, hidden[:, lo : lo + n_targets]).expand(self.rows, -1, -1)
            tgt = targets[start + lo : start + lo + n_targets]
            picked = lp.gather(-1, tgt.view(1, -1, 1).expand(self.rows, -1, 1))[..., 0]
            self.nll[:, start + lo : start + lo + n_targets] = -picked
            if sink is not None:
                sink(start + lo, lp)
        self.seconds += time.perf_counter() - t0


# Above this many bytes of stored reference distributions, ask for reference=False.
REFERENCE_LIMIT = 4 << 30


@dataclass
class Reference:
    result: RowResult
    log_probs: torch.Tensor  # [T-1, vocab] the full cache's next-token log-probabilities


def full_reference(model, tokens: torch.Tensor, progress=True, label: str = "stream") -> Reference:
    """The full cache's distributions for every prediction, from chunked prefill.

    Chunks through a full cache are exactly a full-sequence forward, and much cheaper
    than decoding the reference token by token in lockstep.
    """
    targets = tokens[1:]
    vocab = model.get_output_embeddings().weight.shape[0]
    if targets.numel() * vocab * 4 > REFERENCE_LIMIT:
        raise KvevictError(
            f"{tokens.numel()} tokens x {vocab} vocabulary is too much full-cache reference to hold: "
            "run without the reference (no KL / top-1), or with fewer tokens"
        )
    store = torch.empty(targets.numel(), vocab)
    kept = KeptTracker()
    lane = _Lane(model, EvictingCache(model, "full", budget=None, observers=[kept]), 1, targets.numel())

    def keep(at: int, lp: torch.Tensor) -> None:
        store[at : at + lp.shape[1]] = lp[0]

    with torch.inference_mode(), bars(progress) as bar:
        task = bar.add_task(f"{label}: full-cache reference", total=tokens.numel())
        for start in range(0, tokens.numel(), 512):
            lane.feed(tokens[start : start + 512], start, targets, keep)
            bar.advance(task, min(512, tokens.numel() - start))
        bar.remove_task(task)
    result = RowResult(
        policy="full", budget=None, positions="original", nll=lane.nll[0].clone(),
        kl=torch.zeros(targets.numel()), agree=torch.ones(targets.numel(), dtype=torch.bool),
        max_kept=kept.most, seconds=lane.seconds,
    )
    return Reference(result, store)


def compare(
    model,
    tokens: torch.Tensor,
    policies: Sequence[str],
    budget: int,
    positions: str = "original",
    reference: bool | Reference = True,
    progress=True,
    label: str = "stream",
    on_step: Callable[[int], None] | None = None,
) -> tuple[list[RowResult], RowResult | None]:
    """Streaming NLL of every policy (rows of one batch) and of the full cache.

    Returns (one RowResult per policy, the full cache's RowResult or None). With
    `reference` (True, or a `Reference` computed once for several calls), each policy
    row also gets per-token KL(full || policy) and top-1 agreement with the full cache.
    `progress` is a bool or an existing rich Progress to add a bar to.
    """
    tokens = _validate(tokens)
    targets = tokens[1:]
    steps = targets.numel()
    with torch.inference_mode():
        kept, sinks = KeptTracker(), SinkTracker()
        cache = EvictingCache(model, list(policies), budget=budget, positions=positions, observers=[kept, sinks])
        lane = _Lane(model, cache, len(policies), steps)
        budget = cache.budget  # None when every row is the full cache
        if isinstance(reference, Reference):
            full = reference
        else:
            full = full_reference(model, tokens, progress, label) if reference else None
        if full is not None:
            kl = torch.zeros(len(policies), steps)
            agree = torch.zeros(len(policies), steps, dtype=torch.bool)

        def compare_rows(at: int, lp: torch.Tensor) -> None:
            ref = full.log_probs[at : at + lp.shape[1]]
            kl[:, at : at + lp.shape[1]] = (ref.exp() * (ref - lp)).sum(-1)
            agree[:, at : at + lp.shape[1]] = lp.argmax(-1) == ref.argmax(-1)

        prefill = tokens.numel() if budget is None else min(budget, tokens.numel())
        with bars(progress) as bar:
            task = bar.add_task(f"{label} (budget {budget}, {positions})", total=tokens.numel())
            for start, stop in [(0, prefill)] + [(t, t + 1) for t in range(prefill, tokens.numel())]:
                lane.feed(tokens[start:stop], start, targets, compare_rows if full is not None else None)
                bar.advance(task, stop - start)
                if on_step is not None:
                    on_step(stop)
            bar.remove_task(task)
        results = []
        lost_at = sinks.lost_at(len(cache.layers), cache.layers[0].heads)  # [layers, rows, heads]
        loss = held_sink_loss(cache.kept_positions())
        pinned_lost = held_pinned_lost(cache.kept_positions(), [p.pinned for p in cache.row_policies()])
        for row, policy in enumerate(cache.row_policies()):
            results.append(
                RowResult(
                    policy=policy.spec(),
                    budget=budget,
                    positions=positions,
                    nll=lane.nll[row].clone(),
                    kl=kl[row].clone() if full is not None else None,
                    agree=agree[row].clone() if full is not None else None,
                    max_kept=kept.most,
                    pinned_sink_evicted=bool(pinned_lost[row]),
                    first_token_evicted=bool((lost_at[:, row] >= 0).any()),
                    sink_loss=float(loss[row]),
                    sink_lost_at=lost_at[:, row].tolist(),
                    seconds=lane.seconds,
                )
            )
        return results, (full.result if full is not None else None)


def streaming_ppl(
    model,
    tokens: torch.Tensor,
    policy: str = "streamingllm",
    budget: int = 256,
    positions: str = "original",
    progress: bool = True,
) -> RowResult:
    """Streaming perplexity of one policy (the library form of `kvevict ppl`)."""
    rows, _ = compare(model, tokens, [policy], budget, positions, reference=False, progress=progress)
    return rows[0]
