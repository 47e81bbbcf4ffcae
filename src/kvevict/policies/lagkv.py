"""`lagkv`: lag-relative information (Liang et al., 2025, "LagKV: Lag-Relative Information of the KV
Cache Tells Which Tokens Are Important", arXiv 2504.04704), as kvpress's `LagKVPress` computes it
(NVIDIA/kvpress, `kvpress/presses/lagkv_press.py`).

No attention is needed: the held entries, in positional order, are cut after the first `n_sink` into
partitions of `lag_size`. Each partition is judged against the one after it (its "lag"): per dimension,
the next partition's minimum and maximum normalise this partition's keys (and values), and a token's
score is the standard deviation of its normalised key across dimensions, soft-maxed within the
partition (the same for values; the two are averaged). A token that stands out against what follows
it carries information the next tokens do not repeat. The `n_sink` first tokens and the last partition
with the remainder after it (there is nothing after them to compare with) score 1, above every judged
token. By default (`cross_scoring=False`) a judged token's score is its rank within its partition
over `lag_size`, so each partition keeps about the same share; `cross_scoring=True` keeps the
soft-maxed scores, comparable across partitions (kvpress suggests it under Ada-KV).

A sequence shorter than `n_sink + 2 * lag_size` has no partition with a lag after it: then, as in
kvpress, the sinks score 1 and the rest by recency.

Under a hard budget (a stream) every eviction partitions what is held at that moment afresh; the paper
compresses each partition once, when its lag has arrived. The score reads keys and values of the held
entries only, so the policy keeps no state across steps. Per-head budgets (`adakv:lagkv`) hand each head
its own entries (other heads' as pads at position -1): a head is scored on its own entries alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import KvevictError
from .base import Policy, SlotView


@dataclass(eq=False)
class LagKV(Policy):
    n_sink: int = 4
    lag_size: int = 128
    cross_scoring: bool = False

    reads_keys = True  # it scores keys (and values), so token 0 may go on some heads and stay on others

    def __post_init__(self) -> None:
        if self.n_sink < 0:
            raise KvevictError(f"lagkv:n_sink must be >= 0, got {self.n_sink}")
        if self.lag_size < 2:
            raise KvevictError(f"lagkv:lag_size must be >= 2 (a partition needs a spread), got {self.lag_size}")

    def spec(self) -> str:
        return f"lagkv:n_sink={self.n_sink},lag_size={self.lag_size},cross_scoring={str(self.cross_scoring).lower()}"

    def scores(self, view: SlotView) -> torch.Tensor:
        """`[b, H_kv, n]`: the lag-relative score of every held slot (pads, position -1, score -inf)."""
        keys, values, order = view.keys(), view.values(), view.order()
        valid = view.in_order(view.positions) >= 0
        counts = valid.sum(dim=-1)  # [b, H_kv]
        n = valid.shape[-1]
        ordered = torch.full(valid.shape, float("-inf"), dtype=keys.dtype, device=keys.device)
        # one KV head at a time: its keys and values in order, and the scoring's few copies of them, are an
        # H_kv-th of every head's at once (at 131,072 entries of Llama-3.1-8B's shape, 64 MB each, not 512)
        for h in range(keys.shape[1]):
            k, v = _in_order(order[:, h], keys[:, h]), _in_order(order[:, h], values[:, h])  # [b, n, D]
            if bool((counts[:, h] == n).all()):
                ordered[:, h] = lag_scores(k, v, self.n_sink, self.lag_size, self.cross_scoring)
                continue
            for b in counts[:, h].nonzero()[:, 0].tolist():  # per-head budgets: pads sort first
                m = int(counts[b, h])
                ordered[b, h, n - m:] = lag_scores(k[b, n - m:], v[b, n - m:], self.n_sink, self.lag_size,
                                                   self.cross_scoring)
        return view.from_order(ordered)


def _in_order(order: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`x` `[..., n, D]` per slot, rearranged by `order` `[..., n]` so that the slot axis runs by position."""
    return x.gather(-2, order[..., None].expand_as(x))


def lag_scores(keys: torch.Tensor, values: torch.Tensor, n_sink: int, lag: int, cross: bool) -> torch.Tensor:
    """`[..., n]` scores of a sequence's keys and values `[..., n, D]` in positional order (kvpress's
    `LagKVPress.score`, at the keys' dtype as there)."""
    n = keys.shape[-2]
    score = torch.ones(keys.shape[:-1], dtype=keys.dtype, device=keys.device)
    if n < n_sink + 2 * lag:  # no partition has a lag after it: the sinks, then recency
        if n > n_sink:
            score[..., n_sink:] = (torch.arange(n - n_sink, device=keys.device) / (n - n_sink)).to(keys.dtype)
        return score
    end = n_sink + ((n - n_sink) // lag) * lag
    judged = (_states_score(keys[..., n_sink:end, :], lag) + _states_score(values[..., n_sink:end, :], lag)) / 2
    if not cross:  # rank within the partition, over lag_size
        judged = (judged.argsort(dim=-1).argsort(dim=-1) / lag).to(keys.dtype)
    score[..., n_sink:end - lag] = judged.flatten(-2)
    return score


def _states_score(states: torch.Tensor, lag: int) -> torch.Tensor:
    """`[..., P - 1, lag]` from `states` `[..., P * lag, D]`: each partition normalised by the min and max
    of the next one, per dimension; the spread across dimensions, soft-maxed within the partition."""
    parts = states.unflatten(-2, (-1, lag))  # [..., P, lag, D]
    ref, own = parts[..., 1:, :, :], parts[..., :-1, :, :]
    low = ref.min(dim=-2, keepdim=True).values
    high = ref.max(dim=-2, keepdim=True).values
    return ((own - low) / (high - low)).std(dim=-1).softmax(dim=-1)
