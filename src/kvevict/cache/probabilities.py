"""Attention probabilities computed by hand, for the statistics policies ask for.

SDPA gives the layer's output but never its probabilities. These functions compute
them only where a policy asked: one decode query over every key (`decode_probs`), or
many queries in blocks (`blockwise_probs`), so a long prefill never materialises an
L x L matrix per head. Grouped-query throughout: keys are never repeated per query head.

Dtypes: the logits are products of keys and queries in the model's dtype (what the
model's own attention computes), then widened to float32 before the softmax, so every
probability a statistic sums is float32 whatever the model is held in. Summed in bf16,
a running total of 64 cannot take an increment below 0.25 (8 significant bits): H2O's
heavy hitters would stop moving once their totals grew.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

# Elements of one block of attention logits: bounds the memory of statistics capture.
BLOCK_ELEMENTS = 1 << 24
# Queries per block of `attention_mass`: small enough that a causal prefill's blocks skip most of the keys
# their queries cannot see (the triangle above the diagonal), large enough that each product stays a matmul.
QUERY_BLOCK = 256


def causal(q: int, kv: int, device: torch.device) -> tuple[torch.Tensor | None, bool]:
    """SDPA's mask for `q` new tokens after `kv - q` entries that every one of them sees: `(mask, is_causal)`.
    One token sees everything (no mask); a forward without entries before it is SDPA's own causal mask;
    otherwise `[q, kv]` bool, bottom-right aligned (query i sees every earlier entry and new tokens <= i)."""
    if q == 1:
        return None, False
    if kv == q:
        return None, True
    cols = torch.arange(kv, device=device)
    rows = torch.arange(q, device=device) + (kv - q)
    return cols[None, :] <= rows[:, None], False


def sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
    scaling: float,
) -> torch.Tensor:
    """`scaled_dot_product_attention`, grouped-query without repeating keys: query `[B, H_q, q, D]`, key/value
    `[B, H_kv, n, D]` -> `[B, H_q, q, D]`."""
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=is_causal, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
    )


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
    heads of its KV group: `[b, H_kv, n]` float32 (shapes as in `blockwise_probs`).

    The same numbers as summing `blockwise_probs` (up to float rounding), for less work,
    which matters for a long prefill's statistics (H2O reads every query's attention):
    * a block of queries is multiplied only with the keys up to the last one any of its
      queries can see (`cut`: past it, every key sits after the block's last query, in
      every row and head), so a causal prefill computes about half the L x L logits;
    * the softmax is taken in place and its normalisation folded into the sum over the
      queries (one batched product of the exponentials with each query's 1 / sum).
    A query that sees no key gives NaN, as the softmax of a row of -inf does.
    """
    b, hq, m, d = query.shape
    hkv, n = keys.shape[1], keys.shape[2]
    g = hq // hkv
    total = torch.zeros(b, hkv, n, dtype=torch.float32, device=query.device)
    if m == 0 or n == 0:
        return total
    key_pos = key_pos.expand(b, hkv, n)
    # reach[j]: the earliest position among the keys at index >= j (any row, any head), non-decreasing in j
    reach = key_pos.reshape(-1, n).amin(0).flip(0).cummin(0).values.flip(0).contiguous()
    block = max(1, min(QUERY_BLOCK, BLOCK_ELEMENTS // max(1, b * hq * n)))
    starts = list(range(0, m, block))
    last = torch.stack([query_pos[s : s + block].max() for s in starts])
    cuts = torch.searchsorted(reach, last.to(reach.dtype), right=True).tolist()  # one sync for every block
    grouped = query.reshape(b, hkv, g, m, d)
    for start, cut in zip(starts, cuts):
        if cut == 0:  # no query of the block sees any key: NaN, as the softmax over nothing but -inf
            total[:] = float("nan")
            continue
        q_pos = query_pos[start : start + block]
        rows = q_pos.numel()
        q_blk = grouped[:, :, :, start : start + block].reshape(b, hkv, g * rows, d)
        logits = torch.matmul(q_blk, keys[:, :, :cut].transpose(-1, -2)).float().mul_(scaling)  # [b, H_kv, g*rows, cut]
        hidden = key_pos[:, :, None, :cut] > q_pos[None, None, :, None]  # [b, H_kv, rows, cut]
        logits.view(b, hkv, g, rows, cut).masked_fill_(hidden[:, :, None], float("-inf"))
        logits.sub_(logits.amax(-1, keepdim=True)).exp_()
        inverse = logits.sum(-1).reciprocal_()  # [b, H_kv, g*rows]
        total[:, :, :cut] += torch.matmul(inverse[:, :, None, :], logits)[:, :, 0]
    return total
