"""kvevict's attention function: SDPA for the output, plus the statistics policies need.

Registered in transformers' `AttentionInterface` as `"kvevict"`. It computes the layer's
output with `scaled_dot_product_attention` (grouped-query, no `repeat_kv`), then hands
the queries to the cache layer that was just updated, which asks its policies what
they need. Attention probabilities are only ever computed for the layers, rows and
queries a policy asked for, in query blocks, so a long prefill never materialises an
L x L matrix per head. One exception: a decode step where every row's policy wants
that query's attention (H2O) computes attention by hand once and keeps the
probabilities, because SDPA cannot return them and a second pass costs as much again. transformers'
eager attention / `output_attentions` is not involved.

The mask is built here, not by transformers: after eviction the cache's slots are no
longer contiguous positions, and the right mask is simply "every kept entry is visible,
the new tokens are causal among themselves". A 2-D padding mask is refused by the mask
hook below, because a left-padded row would need per-row positions and budgets.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .errors import KvevictError

NAME = "kvevict"
# Elements of one block of attention logits: bounds the memory of statistics capture.
BLOCK_ELEMENTS = 1 << 24

_pending = None


def set_pending(layer) -> None:
    """Called by `EvictingLayer.update`: the next attention call belongs to `layer`."""
    global _pending
    if _pending is not None and _pending.pending:
        stale, _pending = _pending, None
        stale.pending = False
        raise KvevictError(
            "EvictingCache needs kvevict's attention function, but the model ran another one: "
            "call kvevict.attach(model) (or model.set_attn_implementation('kvevict'))"
        )
    _pending = layer


def _take_pending(layer_idx: int | None):
    global _pending
    layer, _pending = _pending, None
    if layer is not None and layer_idx is not None and layer.index != layer_idx:
        raise RuntimeError(f"cache layer {layer.index} updated but attention ran for layer {layer_idx}")
    return layer


def model_positions(
    kwargs: dict, q: int, default_start: int, device: torch.device, check_rows: bool = True
) -> torch.Tensor:
    """The positions the model rotated this forward's tokens with, `[q]`.

    transformers passes `position_ids` down to the attention layer; rows that disagree
    mean a padded batch, which the cache cannot bound correctly.
    """
    inner = kwargs.get("kwargs", kwargs)
    position_ids = inner.get("position_ids") if isinstance(inner, dict) else None
    if position_ids is None:
        return torch.arange(default_start, default_start + q, device=device)
    position_ids = position_ids.reshape(-1, position_ids.shape[-1])
    if check_rows and position_ids.shape[0] > 1 and not bool((position_ids == position_ids[:1]).all()):
        raise padded_batch_error()
    return position_ids[0, -q:].to(device)


def padded_batch_error() -> KvevictError:
    return KvevictError(
        "padded batches are not supported: every row must be a full sequence of the same length "
        "(drop the attention_mask padding, or run rows of different lengths as separate batches)"
    )


def kvevict_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    layer = _take_pending(getattr(module, "layer_idx", None))
    q_len, kv_len = query.shape[2], key.shape[2]
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    query_positions = None
    if layer is not None and (layer.owner.positions == "cache" or layer.owner.query_window):
        # Only position-shift mode and policies that remember queries need them.
        start = layer.n if layer.owner.positions == "cache" else layer.seen - layer.new
        query_positions = model_positions(kwargs, q_len, start, query.device, check_rows=False)
        if layer.owner.positions == "cache":
            target = torch.arange(layer.n, layer.n + q_len, device=query.device)
            if not torch.equal(query_positions, target):
                rotary = layer.owner.rotary
                cos, sin = rotary.at(query_positions)
                raw = rotary.unrotate(query, cos, sin)
                cos, sin = rotary.table(layer.n + q_len)
                query = rotary.rotate(raw, cos[layer.n :], sin[layer.n :])
            query_positions = target
    mask = None
    is_causal = False
    if attention_mask is not None:
        if layer is not None:
            raise KvevictError(
                "a prepared 4-D attention mask cannot be combined with EvictingCache (its slots are not positions): "
                "pass no attention_mask, the cache builds the right one"
            )
        mask = attention_mask  # a caller's own 4-D mask, without kvevict's cache: plain SDPA semantics
    elif q_len > 1:
        if kv_len == q_len:
            is_causal = True
        else:
            # bottom-right aligned: query i sees every cached entry and new tokens <= i
            cols = torch.arange(kv_len, device=query.device)
            rows = torch.arange(q_len, device=query.device) + (kv_len - q_len)
            mask = cols[None, :] <= rows[:, None]
    probs = None
    wants_probs = layer.plan() if layer is not None else False  # the cache asks its policies first
    if wants_probs and q_len == 1:
        # A decode step whose policies want this query's attention (H2O): compute it
        # once by hand and keep the probabilities, instead of SDPA plus a second softmax.
        out, probs = decode_attention(query, key, value, scaling)
    else:
        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=mask,
            is_causal=is_causal,
            scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1],
        )
    if layer is not None:
        layer.finish(query, query_positions, scaling, probs)
    return out.transpose(1, 2).contiguous(), None


def decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query per row that also returns its probabilities.

    query `[b, H_q, 1, D]`, key/value `[b, H_kv, n, D]` (grouped-query: no repeat).
    Returns the output `[b, H_q, 1, D]` and the probabilities `[b, H_kv, group, n]`
    (float32). Every cached entry is visible to the newest token, so there is no mask.
    """
    b, hq, _, d = query.shape
    hkv, n = key.shape[1], key.shape[2]
    probs = decode_probs(query, key, scaling)
    out = torch.bmm(probs.to(value.dtype).view(b * hkv, hq // hkv, n), value.reshape(b * hkv, n, d))
    return out.view(b, hq, 1, d), probs


def decode_probs(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention probabilities of one query per row over every key, `[b, H_kv, group, n]` float32."""
    b, hq, _, d = query.shape
    hkv, n = key.shape[1], key.shape[2]
    # Merging (row, head) is a view: the cache's buffers are contiguous over both.
    grouped = query.reshape(b * hkv, hq // hkv, d)
    logits = torch.bmm(grouped, key.reshape(b * hkv, n, d).transpose(1, 2)).float()
    return torch.softmax(logits.mul_(scaling), dim=-1).view(b, hkv, hq // hkv, n)


def kvevict_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> None:
    """transformers' mask hook: only used to refuse padding; the real mask is built above."""
    if attention_mask is not None and attention_mask.dtype == torch.bool and not bool(attention_mask.all()):
        raise padded_batch_error()
    if attention_mask is not None and attention_mask.dtype != torch.bool and not bool((attention_mask != 0).all()):
        raise padded_batch_error()
    return None


def register() -> None:
    AttentionInterface.register(NAME, kvevict_attention)
    AttentionMaskInterface.register(NAME, kvevict_mask)


def attach(model) -> None:
    """Route `model`'s attention through kvevict (idempotent)."""
    register()
    if getattr(model.config, "_attn_implementation", None) != NAME:
        model.set_attn_implementation(NAME)


def attention_mass(
    query: torch.Tensor,
    query_pos: torch.Tensor,
    keys: torch.Tensor,
    key_pos: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Attention probability each key receives, summed over queries and the query heads
    of its KV group: `[b, H_kv, n]`.

    query `[b, H_q, m, D]` at stream positions `query_pos` `[m]`; keys `[b, H_kv, n, D]`
    at stream positions `key_pos` `[b, H_kv, n]`. A query sees keys at positions <= its
    own. Computed in blocks of queries so memory stays `O(block * n)`. (A decode step's
    single query sees every key: `decode_probs`.)
    """
    b, hq, m, d = query.shape
    hkv, n = keys.shape[1], keys.shape[2]
    group = hq // hkv
    grouped = query.reshape(b, hkv, group, m, d)
    total = torch.zeros(b, hkv, n, dtype=torch.float32, device=query.device)
    block = max(1, BLOCK_ELEMENTS // max(1, b * hq * n))
    for start in range(0, m, block):
        q_blk = grouped[:, :, :, start : start + block]
        logits = torch.einsum("bhgmd,bhnd->bhgmn", q_blk, keys).float() * scaling
        visible = key_pos[:, :, None, None, :] <= query_pos[start : start + block][None, None, None, :, None]
        logits = logits.masked_fill(~visible, float("-inf"))
        total += torch.softmax(logits, dim=-1).sum(dim=(2, 3))
    return total
