"""Attention probabilities computed by hand, for the statistics policies ask for.

SDPA gives the layer's output but never its probabilities. These functions compute
them only where a policy asked: one decode query over every key (`decode_probs`), or
many queries in blocks (`blockwise_probs`), so a long prefill never materialises an
L x L matrix per head. Grouped-query throughout: keys are never repeated per query head.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

# Elements of one block of attention logits: bounds the memory of statistics capture.
BLOCK_ELEMENTS = 1 << 24


def decode_probs(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention probabilities of one query per row over every key, `[b, H_kv, group, n]` float32.

    query `[b, H_q, 1, D]`, key `[b, H_kv, n, D]`. The newest token sees every key: no mask.
    """
    b, hq, _, d = query.shape
    hkv, n = key.shape[1], key.shape[2]
    # Merging (row, head) is a view: the cache's buffers are contiguous over both.
    grouped = query.reshape(b * hkv, hq // hkv, d)
    logits = torch.bmm(grouped, key.reshape(b * hkv, n, d).transpose(1, 2))
    if logits.dtype != torch.float32:  # a no-op call per layer and step saved where it would be one
        logits = logits.float()
    return torch.softmax(logits.mul_(scaling), dim=-1).view(b, hkv, hq // hkv, n)


def decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query per row that also returns its probabilities.

    query `[b, H_q, 1, D]`, key/value `[b, H_kv, n, D]`. Returns the output
    `[b, H_q, 1, D]` and the probabilities `[b, H_kv, group, n]` (float32).
    """
    b, hq, _, d = query.shape
    hkv, n = key.shape[1], key.shape[2]
    probs = decode_probs(query, key, scaling)
    weights = probs if probs.dtype == value.dtype else probs.to(value.dtype)
    out = torch.bmm(weights.view(b * hkv, hq // hkv, n), value.reshape(b * hkv, n, d))
    return out.view(b, hq, 1, d), probs


def blockwise_probs(
    query: torch.Tensor,
    query_pos: torch.Tensor,
    keys: torch.Tensor,
    key_pos: torch.Tensor,
    scaling: float,
) -> Iterator[tuple[int, torch.Tensor]]:
    """Attention probabilities of many queries, one block of queries at a time.

    query `[b, H_q, m, D]` at stream positions `query_pos` `[m]`; keys `[b, H_kv, n, D]`
    at positions `key_pos` (`[b, H_kv, n]`, or `[n]` shared). A query sees keys at
    positions <= its own. Yields `(first query, probs [b, H_kv, group, block, n])` float32,
    so memory stays `O(block * n)`.
    """
    b, hq, m, d = query.shape
    hkv, n = keys.shape[1], keys.shape[2]
    grouped = query.reshape(b, hkv, hq // hkv, m, d)
    key_pos = key_pos.expand(b, hkv, n)
    block = max(1, BLOCK_ELEMENTS // max(1, b * hq * n))
    for start in range(0, m, block):
        q_blk = grouped[:, :, :, start : start + block]
        logits = torch.einsum("bhgmd,bhnd->bhgmn", q_blk, keys).float() * scaling
        visible = key_pos[:, :, None, None, :] <= query_pos[start : start + block][None, None, None, :, None]
        logits = logits.masked_fill(~visible, float("-inf"))
        yield start, torch.softmax(logits, dim=-1)


def attention_mass(
    query: torch.Tensor,
    query_pos: torch.Tensor,
    keys: torch.Tensor,
    key_pos: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Attention probability each key receives, summed over the queries and the query
    heads of its KV group: `[b, H_kv, n]` float32 (shapes as in `blockwise_probs`)."""
    b, hkv, n = keys.shape[0], keys.shape[1], keys.shape[2]
    total = torch.zeros(b, hkv, n, dtype=torch.float32, device=query.device)
    for _, probs in blockwise_probs(query, query_pos, keys, key_pos, scaling):
        total += probs.sum(dim=(2, 3))
    return total
