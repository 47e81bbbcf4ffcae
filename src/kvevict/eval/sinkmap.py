"""The attention-sink map of a model on a text.

For every layer and query head: the share of attention that goes to each of the first
`k` positions, and which positions anywhere in the early text soak up attention from
far-away queries (token 0 almost always; often also the first newline or period).
That is what decides whether a policy may evict a token: a window policy drops
exactly these early tokens.

Measured on distant queries only: the *probe* queries are the second half of the text,
and the scanned keys are in its first quarter, so no key is within a quarter of the
text of any probe query and local attention (a token attending to its neighbours)
cannot pass for a sink. One plain forward with a temporary attention function that
computes the output with SDPA and the probabilities of the probe queries blockwise
(never an L x L matrix); the model's own attention is restored afterwards.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ..cache.model_info import text_config
from ..cache.statistics.probabilities import blockwise_probs
from ..errors import KvevictError

NAME = "kvevict_sinkmap"
# The model hands this forward keyword down to every attention call: the collector
# travels with the forward instead of sitting in a module global.
COLLECTOR_KEY = "kvevict_sinkmap_collector"


@dataclass
class SinkMap:
    """What `sink_map` measured. JSON-serialisable through `to_dict`.

    share: `[layers][heads][k]` mean attention probability of a probe query on positions
    0..k-1. scan_share: `[layers][heads][scan]` the same for every scanned position (the
    first quarter of the text; left out of `to_dict`, which keeps its mean per position). sinks:
    the scanned positions that at least a `min_heads` share of the (layer, head) pairs give
    `threshold` or more of their attention, with their token, mean share and that count.
    """

    tokens: list[str]
    share: list[list[list[float]]]
    scan_share: list[list[list[float]]]
    probe_from: int
    threshold: float
    min_heads: float = 0.05
    sinks: list[dict] = field(default_factory=list)

    @property
    def k(self) -> int:
        return len(self.share[0][0]) if self.share else 0

    def to_dict(self) -> dict:
        return {
            "k": self.k,
            "tokens": self.tokens,
            "share": self.share,
            "position_mean": self.position_mean(),
            "probe_from": self.probe_from,
            "threshold": self.threshold,
            "min_heads": self.min_heads,
            "sinks": self.sinks,
            "layer_mean": self.layer_mean(),
        }

    def position_mean(self) -> list[float]:
        """Share of every scanned position, averaged over layers and heads."""
        return torch.tensor(self.scan_share).mean(dim=(0, 1)).tolist()

    def layer_mean(self) -> list[list[float]]:
        """`[layers][k]` share of each of the first k positions averaged over heads."""
        return [[sum(h[i] for h in layer) / len(layer) for i in range(self.k)] for layer in self.share]

    def table(self) -> list[dict]:
        """One row per layer: share on position 0, on the first k together, and the head most and least sunk."""
        rows = []
        for layer, heads in enumerate(self.share):
            first = [sum(h) for h in heads]
            rows.append(
                {
                    "layer": layer,
                    "pos0": sum(h[0] for h in heads) / len(heads),
                    "first_k": sum(first) / len(first),
                    "min_head_first_k": min(first),
                    "max_head_first_k": max(first),
                }
            )
        return rows


class _Collector:
    """Per layer, the attention the probe queries pay each scanned key, summed: `[H_q, scan]`."""

    def __init__(self, layers: int, probe_from: int, scan: int) -> None:
        self.probe_from = probe_from
        self.scan = scan
        self.sums: list[torch.Tensor | None] = [None] * layers


def _sinkmap_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA for the output; the probe queries' probabilities for the collector the forward carries."""
    collector = kwargs.pop(COLLECTOR_KEY, None)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = F.scaled_dot_product_attention(
        query, key, value, is_causal=query.shape[2] > 1, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
    )
    if collector is not None:
        _collect(collector, module.layer_idx, query, key, scaling)
    return out.transpose(1, 2).contiguous(), None


def _collect(collector: _Collector, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
    """Sum over probe queries of their attention probabilities on the scanned keys, per query head."""
    _, hq, t, _ = query.shape
    probe = query[:, :, collector.probe_from :]
    q_pos = torch.arange(collector.probe_from, t, device=query.device)
    k_pos = torch.arange(t, device=query.device)
    total = torch.zeros(hq, collector.scan, dtype=torch.float64, device=query.device)
    for _, probs in blockwise_probs(probe, q_pos, key, k_pos, scaling):  # [b, H_kv, group, block, t]
        total += probs[..., : collector.scan].sum(dim=(0, 3)).reshape(hq, collector.scan).double()
    collector.sums[layer] = total


@contextmanager
def _measuring(model):
    AttentionInterface.register(NAME, _sinkmap_attention)
    AttentionMaskInterface.register(NAME, lambda *args, **kwargs: None)
    before = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def sink_map(
    model, tokenizer, ids: torch.Tensor, k: int = 8, threshold: float = 0.1, min_heads: float = 0.05
) -> SinkMap:
    """Measure the sink map of `model` on the token ids `ids` (`[T]`, T >= 64).

    `k`: how many leading positions get a column in the map. A scanned position is a
    sink when at least a `min_heads` share of all (layer, head) pairs give it at least
    `threshold` of their attention (uniform attention over a T-token context would give
    each key about 1/T). Sinks are often layer-specific, which is why the rule counts
    heads rather than averaging over the whole model.
    """
    if ids.dim() != 1:
        raise KvevictError("sink_map takes one text: a 1-D tensor of token ids")
    t = ids.numel()
    if t < 64:
        raise KvevictError(f"the sink map needs at least 64 tokens of text, got {t}")
    if not 1 <= k <= t // 4:
        raise KvevictError(f"k must be in [1, {t // 4}] (a quarter of the {t}-token text), got {k}")
    text = text_config(model)
    probe_from, scan = t // 2, t // 4
    collector = _Collector(text.num_hidden_layers, probe_from, scan)
    with _measuring(model), torch.inference_mode():
        model.base_model(input_ids=ids[None].long(), use_cache=False, **{COLLECTOR_KEY: collector})
    probes = t - probe_from
    per_layer = [(s / probes).tolist() for s in collector.sums]  # [layers][heads][scan]
    share = [[head[:k] for head in layer] for layer in per_layer]
    grid = torch.tensor(per_layer)
    mean = grid.mean(dim=(0, 1))
    strong = (grid >= threshold).sum(dim=(0, 1))
    pairs = grid.shape[0] * grid.shape[1]
    head = ids[:scan].tolist()
    pieces = tokenizer.convert_ids_to_tokens(head) if tokenizer is not None else [str(i) for i in head]
    sinks = [
        {"position": p, "token": pieces[p], "mean_share": float(mean[p]), "heads_over_threshold": int(strong[p])}
        for p in range(scan)
        if strong[p] >= min_heads * pairs
    ]
    return SinkMap(
        tokens=pieces[:k], share=share, scan_share=per_layer, probe_from=probe_from, threshold=threshold,
        min_heads=min_heads, sinks=sinks,
    )
