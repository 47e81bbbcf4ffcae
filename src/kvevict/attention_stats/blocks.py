"""Many queries, one block of them at a time: what the caller asks is reduced block by block, and no
`queries x keys` matrix is held beyond one block (`Workspace`).

`attend` is the blocked kernel: each block's logits (`logits`, or the caller's own products: the
position shift's two rotations), masked (`Mask`), soft-maxed, and reduced into what was asked: the output
with the values, the probability every key got summed over the queries and the query group (H2O's
"new"), the last query's row (TOVA's "last"), the largest probability over the queries and the group
(KVzip's reconstruction). `probability_blocks` hands the blocks' probabilities out for a caller that
reduces them its own way (the sink map), and `QueryRows` hands out one query's logits at a time for a
replay that steps through its queries, computing them a block at a time.

Keys are grouped-query and never repeated: keys `[B, H_k, n, D]` with `H_k` the KV heads, or 1 when every
query head reads the same keys (a per-head layer's whole row, masked to each head's entries); the
statistics are per KV head, `heads` of them (`H_k` unless said).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .workspace import Workspace

#: `(start, stop)` -> the query-key products `[B, H_kv, group, stop - start, n]` of those queries, unscaled, in
#: the model's dtype (the kernel widens and scales them)
Products = Callable[[int, int], torch.Tensor]


@dataclass(frozen=True)
class Mask:
    """What each query may not see, every part optional, combined (a key hidden by any part is hidden):

    * `hidden` `[B, H_kv or 1, n]`: keys no query sees (another head's entries, holes, a window's padding);
    * `key_pos` `[B, H_kv or 1, n]` with `query_pos` `[m]`: a key at a later position than its query
      (causal by position, so keys may sit in any order);
    * `alive` `[B, H_kv, m, n]`: per query, the keys it sees (a replay's alive sets, per step).
    """

    hidden: torch.Tensor | None = None
    key_pos: torch.Tensor | None = None
    query_pos: torch.Tensor | None = None
    alive: torch.Tensor | None = None

    def block(self, start: int, stop: int) -> torch.Tensor | None:
        """`[B, H_kv or 1, 1, rows or 1, n]` bool, True where queries `start .. stop - 1` may not look (None: no
        key is hidden)."""
        parts = []
        if self.hidden is not None:
            parts.append(self.hidden[:, :, None, None, :])
        if self.query_pos is not None:
            parts.append(self.key_pos[:, :, None, None, :] > self.query_pos[start:stop][:, None])
        if self.alive is not None:
            parts.append(~self.alive[:, :, None, start:stop])
        if not parts:
            return None
        out = parts[0]
        for part in parts[1:]:
            out = out | part
        return out


def products(query: torch.Tensor, keys: torch.Tensor, heads: int | None = None) -> torch.Tensor:
    """The query-key products `[B, heads, group, m, n]` of query `[B, H_q, m, D]` over keys `[B, H_k, n, D]`,
    in their dtype and unscaled (`heads`: the KV heads the statistics are per, `H_k` unless said)."""
    b, hq, m, d = query.shape
    hk, n = keys.shape[1], keys.shape[2]
    heads = heads or hk
    return torch.matmul(query.reshape(b, hk, hq // hk * m, d), keys.transpose(-1, -2)).view(b, heads, hq // heads, m, n)


def logits(query: torch.Tensor, keys: torch.Tensor, scaling: float, workspace: Workspace,
           heads: int | None = None) -> torch.Tensor:
    """The scaled float32 logits `[B, heads, group, m, n]` of one block (`products`), told to the workspace's
    observer."""
    return workspace.held(products(query, keys, heads).float().mul_(scaling))


def softmax(logits: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
    """Probabilities over the last dimension, `hidden` keys (True) masked to -inf first, in place: a row
    that sees nothing is NaN."""
    if hidden is not None:
        logits.masked_fill_(hidden, float("-inf"))
    return torch.softmax(logits, dim=-1)


def weighted(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """probs `[B, H_kv, group, rows, n]` over values `[B, H_k, n, D]` -> the output `[B, H_q, rows, D]`."""
    b, heads, group, rows, n = probs.shape
    hk, d = values.shape[1], values.shape[-1]
    out = torch.matmul(probs.view(b, hk, -1, n).to(values.dtype), values)
    return out.view(b, heads * group, rows, d)


@dataclass
class Attended:
    """What `attend` was asked for, None where not: `out` `[B, H_q, m, D]`; per KV head and key,
    `[B, heads, n]` float32: `sums` (the probability over every query and the query group), `last` (the
    last query's, summed over the group), `maxima` (the largest over the queries and the group)."""

    out: torch.Tensor | None = None
    sums: torch.Tensor | None = None
    last: torch.Tensor | None = None
    maxima: torch.Tensor | None = None


def attend(
    query: torch.Tensor, keys: torch.Tensor, scaling: float, workspace: Workspace, mask: Mask = Mask(), *,
    values: torch.Tensor | None = None, sums: bool = False, last: bool = False, maxima: bool = False,
    heads: int | None = None, products: Products | None = None,
) -> Attended:
    """Attention of query `[B, H_q, m, D]` over keys `[B, H_k, n, D]` (module docstring), a block of
    `Workspace.rows` queries at a time, reduced into what was asked: the output over `values`, `sums`,
    `last`, `maxima` (`Attended`). `products` replaces the plain query-key product when the caller
    rotates its queries per block (their logits are then scaled and masked here as any other).

    Exactness: one block gives the arithmetic of one softmax over all queries. More blocks agree with it
    to float32's rounding, not bit for bit: the sums add each block's in turn (additions reordered, ~1e-7
    relative per block), and the BLAS picks its kernel by a product's shape, so a smaller block's logits
    may take other last bits (measured at head_dim 64, not at 16).
    """
    b, hq, m, _ = query.shape
    heads = heads or keys.shape[1]
    rows = workspace.rows(b * hq * keys.shape[2])
    done = Attended()
    outs = []
    for start in range(0, m, rows):
        stop = min(m, start + rows)
        if products is None:
            block = logits(query[:, :, start:stop], keys, scaling, workspace, heads)
        else:
            block = workspace.held(products(start, stop).float().mul_(scaling))
        probs = softmax(block, mask.block(start, stop))
        if values is not None:
            outs.append(weighted(probs, values))
        if sums:
            summed = probs.sum(dim=(2, 3))
            done.sums = summed if done.sums is None else done.sums.add_(summed)
        if maxima:
            most = probs.amax(dim=(2, 3))
            done.maxima = most if done.maxima is None else torch.maximum(done.maxima, most)
        if last and stop == m:
            done.last = probs[:, :, :, -1].sum(dim=2)
    if values is not None:
        done.out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return done


def probability_blocks(
    query: torch.Tensor, keys: torch.Tensor, scaling: float, workspace: Workspace, mask: Mask = Mask()
) -> Iterator[tuple[int, torch.Tensor]]:
    """The probabilities themselves, one block at a time: `(first query, probs [B, H_kv, group, rows, n])`
    float32, for a caller that reduces them its own way (query `[B, H_q, m, D]`, keys `[B, H_kv, n, D]`)."""
    b, hq, m, _ = query.shape
    rows = workspace.rows(b * hq * keys.shape[2])
    for start in range(0, m, rows):
        stop = min(m, start + rows)
        yield start, softmax(logits(query[:, :, start:stop], keys, scaling, workspace), mask.block(start, stop))


class QueryRows:
    """A chunk's scaled logits one query at a time, computed a block of queries at a time: what a replay
    that steps through its queries reads (each step one query's row over every slot of the chunk, then the
    block's output once its steps are done), holding one block, never the chunk's whole matrix."""

    def __init__(self, products: Products, m: int, per_query: int, scaling: float, workspace: Workspace) -> None:
        self.products, self.m, self.scaling, self.workspace = products, m, scaling, workspace
        self.rows = workspace.rows(per_query)
        self.start, self.stop = 0, 0
        self.block: torch.Tensor | None = None  # [B, H_kv, group, rows, n] of queries start .. stop - 1

    def row(self, i: int) -> torch.Tensor:
        """Query `i`'s logits `[B, H_kv, group, n]` (a view into its block: read, not written)."""
        if not self.start <= i < self.stop:
            self.start, self.stop = i, min(self.m, i + self.rows)
            self.block = self.workspace.held(self.products(self.start, self.stop).float().mul_(self.scaling))
        return self.block[:, :, :, i - self.start]

    def ends_block(self, i: int) -> bool:
        """Whether query `i` is its block's last: the block's logits may then be spent (`attend_block`)."""
        return i == self.stop - 1

    def attend_block(self, alive: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The current block's output `[B, H_q, rows, D]`, each query over the slots `alive` `[B, H_kv, rows, n]`
        (the block's logits are masked in place: spent)."""
        return weighted(softmax(self.block, ~alive[:, :, None]), values)
