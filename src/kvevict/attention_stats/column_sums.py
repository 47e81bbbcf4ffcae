"""`column_sums`: the attention every key receives from many queries, summed, without their probabilities.

What H2O's prefill, SnapKV's observation window and Ada-KV's window read: per KV head and key, the
probability summed over the queries and the query heads of its group. Only the sum is wanted, so the
softmax's normalisation is folded into it (no probabilities tensor), and a causal prefill's blocks skip
the keys none of their queries can see.
"""

from __future__ import annotations

import torch

from .workspace import Workspace


def column_sums(
    query: torch.Tensor,
    query_pos: torch.Tensor,
    keys: torch.Tensor,
    key_pos: torch.Tensor,
    scaling: float,
    workspace: Workspace,
    cap: int | None = None,
) -> torch.Tensor:
    """Attention probability each key receives, summed over the queries and the query heads of its KV
    group: `[B, H_kv, n]` float32.

    query `[B, H_q, m, D]` at stream positions `query_pos` `[m]`; keys `[B, H_kv, n, D]` at positions
    `key_pos` (`[B, H_kv, n]`, or `[n]` shared, in any order). A query sees keys at positions <= its own.
    Queries go in blocks of `workspace.rows` (at most `cap`), and for less work:
    * a block of queries is multiplied only with the keys up to the last one any of its
      queries can see (`cut`: past it, every key sits after the block's last query, in
      every row and head), so a causal prefill computes about half the L x L logits;
    * the softmax is taken in place and its normalisation folded into the sum over the
      queries (one batched product of the exponentials with each query's 1 / sum).
    The same numbers as summing the probabilities (up to float rounding: the normalisation is a product
    with each row's reciprocal, and the sum a matrix product, ~1e-7 relative). A query that sees no key
    gives NaN, as the softmax of a row of -inf does.
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
    block = workspace.rows(b * hq * n, cap)
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
        logits = torch.matmul(q_blk, keys[:, :, :cut].transpose(-1, -2)).float().mul_(scaling)  # [B, H_kv, g*rows, cut]
        workspace.held(logits)
        hidden = key_pos[:, :, None, :cut] > q_pos[None, None, :, None]  # [B, H_kv, rows, cut]
        logits.view(b, hkv, g, rows, cut).masked_fill_(hidden[:, :, None], float("-inf"))
        logits.sub_(logits.amax(-1, keepdim=True)).exp_()
        inverse = logits.sum(-1).reciprocal_()  # [B, H_kv, g*rows]
        total[:, :, :cut] += torch.matmul(inverse[:, :, None, :], logits)[:, :, 0]
    return total
