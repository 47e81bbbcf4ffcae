"""`tova`: Token Omission Via Attention (Oren et al., 2024, "Transformers are Multi-State RNNs").

At each eviction the entry that the *current* query attends to least goes: the score
of a cached entry is the attention the last query of the forward pays to it, summed
over all query heads of the layer. Nothing accumulates across steps (unlike H2O): only
the last query's opinion counts, and the current token itself may be the one dropped.

As in the paper, the layer's KV heads share one kept set. A sum ranks the entries as a
mean over the heads would when every head holds them (the mean is the sum divided by
the head count); when heads hold different tokens (`sinkauto+tova`) a token scores the
attention of the heads that hold it, summed.
`per_group=True` scores each KV head by its own query group instead (also summed over
the group), so heads keep different tokens.

A prefill longer than the budget (prompt compression) keeps the entries the prompt's
last query attends to most, which is what the paper does with a long prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import AttentionRequest, Policy, SlotView

STAT = "tova_attention"


@dataclass(eq=False)
class TOVA(Policy):
    per_group: bool = False

    stats = (STAT,)
    needs_attention = True
    requests = ("last",)

    def spec(self) -> str:
        return f"tova:per_group={int(self.per_group)}"

    def request(self, view: SlotView, will_evict: bool) -> AttentionRequest | None:
        # only the step that evicts needs the last query's attention: it overwrites the statistic
        return AttentionRequest(kind="last", stat=STAT, accumulate=False) if will_evict else None

    def scores(self, view: SlotView) -> torch.Tensor:
        """`[b, H_kv, n]`: the last query's attention (summed over its query group), or
        its sum over the whole layer, the same for every KV head."""
        mass = view.stats[STAT]  # [b, H_kv, n] summed over each KV head's query group
        if self.per_group or mass.shape[1] == 1:
            return mass
        positions = view.positions
        # heads hold the same tokens in the same slots (one op, one answer: no `.all()` then `bool`)
        if torch.equal(positions, positions[:, :1].expand_as(positions)):
            return mass.sum(dim=1, keepdim=True).expand_as(mass)
        return _shared_by_position(mass, positions)


def _shared_by_position(mass: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Layer-wide score of each slot's token when KV heads hold different tokens
    (`sinkauto+tova` pins different sinks per head): the attention every head pays to
    that token, summed over the heads that hold it. mass, positions `[b, H_kv, n]`."""
    b, h, n = mass.shape
    flat = positions.reshape(b, h * n)
    tokens, where = torch.unique(flat, return_inverse=True)  # where `[b, H*n]` into tokens
    total = torch.zeros(b, tokens.numel(), dtype=mass.dtype, device=mass.device)
    total.scatter_add_(1, where, mass.reshape(b, h * n))
    return total.gather(1, where).view(b, h, n)
