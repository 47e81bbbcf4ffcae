"""The single-block path: one query per (row, query head), every key in one piece, no loop.

A decode step's query (and a replay step's, and Expected Attention's expected query) has one row of
logits per query head, `B x H_q x n` of them: already within any workspace, so nothing is chunked and
nothing is counted, and a decode step pays two `bmm`s and a softmax, as SDPA's math would.

Dtypes: the logits are products of keys and queries in the model's dtype (what the model's own
attention computes), then widened to float32 before the softmax, so every probability a statistic sums
is float32 whatever the model is held in. Summed in bf16, a running total of 64 cannot take an
increment below 0.25 (8 significant bits): H2O's heavy hitters would stop moving once their totals grew.

Expected Attention's covariance term (`covariance_bias`) is the one part that is not one row of logits:
each key's quadratic form under each query head's covariance passes through `keys @ S`, `D` numbers per
key and query head, so it goes in blocks of keys within the workspace.
"""

from __future__ import annotations

import torch

from .workspace import Workspace


def query_probs(
    query: torch.Tensor, keys: torch.Tensor, scaling: float, hidden: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention probabilities of one query per row and query head over every key, `[B, H_kv, group, n]`
    float32 (grouped-query: keys are never repeated per query head).

    query `[B, H_q, 1, D]`, keys `[B, H_kv, n, D]`. `hidden` (broadcast to `[B, H_kv, group, n]`, True
    hides) masks keys out: a sliding band, another head's or a sink's entries; a row that sees nothing is
    NaN, as the softmax of nothing but -inf is. `bias` `[B, H_kv, group, n]` is added to the scaled
    logits before the mask (Expected Attention's covariance term).
    """
    b, hq, _, d = query.shape
    hkv, n = keys.shape[1], keys.shape[2]
    # Merging (row, head) is a view: the cache's buffers are contiguous over both.
    grouped = query.reshape(b * hkv, hq // hkv, d)
    logits = torch.bmm(grouped, keys.reshape(b * hkv, n, d).transpose(1, 2))
    if logits.dtype != torch.float32:  # a no-op call per layer and step saved where it would be one
        logits = logits.float()
    logits = logits.mul_(scaling).view(b, hkv, hq // hkv, n)
    if bias is not None:
        logits.add_(bias)
    if hidden is not None:
        logits.masked_fill_(hidden, float("-inf"))
    return torch.softmax(logits, dim=-1)


def query_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
    hidden: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query per row that also returns its probabilities (SDPA cannot).

    query `[B, H_q, 1, D]`, keys/values `[B, H_kv, n, D]`, `hidden` as in `query_probs`. Returns the
    output `[B, H_q, 1, D]` and the probabilities `[B, H_kv, group, n]` (float32).
    """
    b, hq, _, d = query.shape
    hkv, n = keys.shape[1], keys.shape[2]
    probs = query_probs(query, keys, scaling, hidden)
    weights = probs if probs.dtype == values.dtype else probs.to(values.dtype)
    out = torch.bmm(weights.view(b * hkv, hq // hkv, n), values.reshape(b * hkv, n, d))
    return out.view(b, hq, 1, d), probs


def covariance_bias(keys: torch.Tensor, cov: torch.Tensor, workspace: Workspace | None = None) -> torch.Tensor:
    """`[B, H_kv, group, n]` each key's quadratic form `k^T S k` under each query head's covariance `S`
    (Expected Attention's covariance term, before its scale). keys `[B, H_kv, n, D]`, cov
    `[B, H_kv, group, D, D]`. The product `keys @ S` is `[B, H_kv, group, rows, D]` for a block of `rows`
    keys, within the workspace's bytes (default `Workspace()`); over every key at once it would be that
    tensor for the whole context, 2.1 GB at 131,072 keys of Llama-3.1-8B's shape. Each block is the same
    contraction as one call over every key."""
    b, h, group, d, _ = cov.shape
    n = keys.shape[2]
    rows = (workspace or Workspace()).rows(b * h * group * d)
    out = keys.new_empty(b, h, group, n)
    for start in range(0, n, rows):
        block = keys[:, :, start:start + rows]
        out[..., start:start + rows] = torch.einsum("bhnd,bhgde,bhne->bhgn", block, cov, block)
    return out
