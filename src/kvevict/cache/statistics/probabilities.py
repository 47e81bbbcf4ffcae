"""The engine's side of the attention-statistics kernel (`kvevict.attention_stats`): its default bound,
and the entries that name it; SDPA's call and its causal mask.

SDPA gives the layer's output but never its probabilities. The kernel computes them only where a
policy asked, in blocks of queries within a workspace (`Workspace`), so a long prefill never
materialises an L x L matrix per head. A cache's bound is `EvictingCache(..., workspace=...)` (bytes, or a
`Workspace` with an observer), held in `LayerSettings.workspace`; without one, `bound` reads
`BLOCK_ELEMENTS` when it is asked.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from ...attention_stats import DEFAULT_BYTES, Mask, Workspace, column_sums, probability_blocks

# Elements of one block of attention logits (float32): the default bound on the memory of statistics capture.
BLOCK_ELEMENTS = DEFAULT_BYTES // 4
# Queries per block of `attention_mass`: small enough that a causal prefill's blocks skip most of the keys
# their queries cannot see (the triangle above the diagonal), large enough that each product stays a matmul.
QUERY_BLOCK = 256


def bound(workspace: Workspace | None, elements: int | None = None) -> Workspace:
    """The cache's `workspace`, or the default: `elements` float32 logits (None: `BLOCK_ELEMENTS`, read now)."""
    if workspace is not None:
        return workspace
    return Workspace((BLOCK_ELEMENTS if elements is None else elements) * 4)


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


def causal_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, workspace: Workspace
) -> torch.Tensor:
    """SDPA for `q` new tokens after `n - q` entries every one of them sees (`causal`'s mask), with the mask
    made a block of queries at a time: query `[B, H_q, q, D]`, key/value `[B, H_kv, n, D]` -> `[B, H_q, q, D]`.

    The mask of a chunk read after a long context is `[q, n]`, and SDPA widens a bool mask to float32: a
    chunk of 4,096 tokens after 128K entries would hold 2.2 GB for it, growing with the context. Here a block
    of `rows` queries holds `rows x n` float32 mask numbers within the workspace (`Workspace.rows`), and sees
    only the keys its last query reaches. Each query's output is the same attention; the blocks may take other
    last bits than one call (SDPA's reduction follows its inputs' shapes), within float32's rounding."""
    q, n = query.shape[2], key.shape[2]
    rows = workspace.rows(n)
    if q == 1 or q == n or rows >= q:  # no mask (a decode step, a first forward's own causal) or one block
        return sdpa(query, key, value, *causal(q, n, query.device), scaling)
    outputs = []
    for start in range(0, q, rows):
        stop = min(q, start + rows)
        reach = n - q + stop  # keys the block's last query sees
        # queries start..stop-1 over keys 0..reach-1 are `causal`'s bottom-right aligned mask of that block
        outputs.append(sdpa(query[:, :, start:stop], key[:, :, :reach], value[:, :, :reach],
                            *causal(stop - start, reach, query.device), scaling))
    return torch.cat(outputs, dim=2)


def sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
    scaling: float,
) -> torch.Tensor:
    """`scaled_dot_product_attention`, grouped-query without repeating keys: query `[B, H_q, q, D]`, key/value
    `[B, H_kv, n, D]` -> `[B, H_q, q, D]`."""
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, is_causal=is_causal, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
    )


def blockwise_probs(
    query: torch.Tensor,
    query_pos: torch.Tensor,
    keys: torch.Tensor,
    key_pos: torch.Tensor,
    scaling: float,
    workspace: Workspace | None = None,
) -> Iterator[tuple[int, torch.Tensor]]:
    """Attention probabilities of many queries, one block of queries at a time (`attention_stats.probability_blocks`).

    query `[b, H_q, m, D]` at stream positions `query_pos` `[m]`; keys `[b, H_kv, n, D]`
    at positions `key_pos` (`[b, H_kv, n]`, or `[n]` shared). A query sees keys at
    positions <= its own. Yields `(first query, probs [b, H_kv, group, block, n])` float32,
    so memory stays within the workspace.
    """
    b, hkv, n = keys.shape[0], keys.shape[1], keys.shape[2]
    mask = Mask(key_pos=key_pos.expand(b, hkv, n), query_pos=query_pos)
    yield from probability_blocks(query, keys, scaling, bound(workspace), mask)


def attention_mass(
    query: torch.Tensor,
    query_pos: torch.Tensor,
    keys: torch.Tensor,
    key_pos: torch.Tensor,
    scaling: float,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """Attention probability each key receives, summed over the queries and the query
    heads of its KV group: `[b, H_kv, n]` float32 (shapes as in `blockwise_probs`), by
    `attention_stats.column_sums` in blocks of at most `QUERY_BLOCK` queries (read now).
    A query that sees no key gives NaN, as the softmax of a row of -inf does.
    """
    return column_sums(query, query_pos, keys, key_pos, scaling, bound(workspace), QUERY_BLOCK)
