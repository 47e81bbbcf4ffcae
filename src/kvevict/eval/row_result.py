"""What one policy measured over one stream (`RowResult`): per-prediction NLL, KL to the full cache and top-1
agreement, what its cache held, and the summary that tables and records read.

It is a record of numbers, apart from the streaming protocol that fills it (`streaming.compare`, the recompute
oracle, lm-eval's rolling log-likelihood), so the harness and the oracle read it without the protocol.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class RowResult:
    """The measurements of one policy over one stream."""

    policy: str
    budget: int | None
    positions: str
    nll: torch.Tensor  # [T-1] negative log-likelihood of tokens 1..T-1
    kl: torch.Tensor | None = None  # [T-1] KL(full || policy) per prediction
    agree: torch.Tensor | None = None  # [T-1] top-1 equal to the full cache's
    hit: torch.Tensor | None = None  # [T-1] top-1 is the next token (lm-eval's is_greedy under protocol=stream)
    max_kept: int = 0
    mean_kept: float = 0.0  # entries a full-attention layer held on average over the stream's steps
    pinned_sink_evicted: bool = False
    first_token_evicted: bool = False
    sink_loss: float = 0.0
    # [layer][kv head] tokens seen when token 0 left, -1 never; None for a layer the budget does not bound
    sink_lost_at: list = field(default_factory=list)
    sliding_window: int | None = None  # the model's own window, when it has sliding-window layers
    seconds: float = 0.0
    scored: torch.Tensor | None = None  # [T-1] which predictions were scored (None: all)
    head: int = 0  # with `scored`: the first `head` predictions are all scored, the rest sampled
    baseline_nll: float | None = None  # the full cache's NLL on the same (sampled) predictions
    # at the end of the stream, per row: {"held": {layer kind: entries per layer and KV head},
    # "kv_bytes": keys+values held, "full_kv_bytes": what a full cache holds for the same tokens}
    memory: dict | None = None
    layer_budgets: list[int] | None = None  # entries each layer kept when they differ by layer (pyramidkv)

    def mean(self, values: torch.Tensor) -> float:
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
        return self.mean(self.nll)

    @property
    def ppl(self) -> float:
        return math.exp(self.nll_mean)

    def _windows(self, values: torch.Tensor, width: int) -> list[tuple[int, int, int, float]]:
        """(first target, last target, scored predictions, mean) of consecutive windows of `width` predictions."""
        out = []
        for start in range(0, values.numel(), width):
            chunk = values[start : start + width].double()
            if self.scored is not None:
                chunk = chunk[self.scored[start : start + width]]
            if chunk.numel():
                out.append((start + 1, min(start + width, values.numel()), chunk.numel(), float(chunk.mean())))
        return out

    def ppl_windows(self, width: int) -> list[dict]:
        """PPL of consecutive windows of predictions, keyed by the window's last target position; `n` the
        predictions scored in it (the blocks of the report's bootstrap)."""
        return [{"start": a, "end": b, "n": n, "ppl": math.exp(m)} for a, b, n, m in self._windows(self.nll, width)]

    def kl_windows(self, width: int) -> list[dict]:
        """KL(full ‖ policy) of the same windows (empty without a full-cache reference)."""
        if self.kl is None:
            return []
        return [{"start": a, "end": b, "n": n, "kl": m} for a, b, n, m in self._windows(self.kl, width)]

    @property
    def full_ppl_same_tokens(self) -> float | None:
        """The full cache's PPL on exactly the predictions this row scored (the oracle's fair baseline)."""
        return None if self.baseline_nll is None else math.exp(self.baseline_nll)

    @property
    def kl_to_full(self) -> float | None:
        return None if self.kl is None else self.mean(self.kl)

    @property
    def top1_agreement(self) -> float | None:
        return None if self.agree is None else self.mean(self.agree)

    def summary(self) -> dict:
        data = {
            "policy": self.policy,
            "budget": self.budget,
            "positions": self.positions,
            "n_predictions": self.n_predictions,
            "ppl": self.ppl,
            "nll_mean": self.nll_mean,
            "max_kept": self.max_kept,
            "mean_kept": self.mean_kept,
            "sink_evicted": self.pinned_sink_evicted,
            "first_token_evicted": self.first_token_evicted,
            "sink_loss": self.sink_loss,
            "seconds": self.seconds,
        }
        if self.sliding_window is not None:
            data["sliding_window"] = self.sliding_window
        if self.memory is not None:
            data["held_per_layer_kind"] = self.memory["held"]
            data["kv_bytes"] = self.memory["kv_bytes"]
            data["full_kv_bytes"] = self.memory["full_kv_bytes"]
            for key in ("kv_bytes_bf16", "full_kv_bytes_bf16"):  # bytes per sequence with floats at 2 bytes
                if key in self.memory:
                    data[key] = self.memory[key]
            if "held_per_head" in self.memory:  # adakv: [layer][KV head] entries each head holds
                data["held_per_head"] = self.memory["held_per_head"]
        if self.baseline_nll is not None:
            data["full_ppl_same_tokens"] = self.full_ppl_same_tokens
        if self.kl is not None:
            data["kl_to_full"] = self.kl_to_full
            data["top1_agreement"] = self.top1_agreement
        return data
