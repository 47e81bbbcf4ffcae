"""Attention statistics: `softmax(Q K^T)` and what policies absorb from it, computed in one place, in
blocks of queries within a bounded workspace.

A policy that scores by attention wants a reduction of the probabilities, never the matrix: H2O the
probability each key got from every query (`column_sums`, or `attend(sums=True)` beside an output),
TOVA the last query's row (`attend(last=True)`), SnapKV and Ada-KV the sums over an observation window
(`column_sums`), KVzip the largest probability a chunk entry got (`attend(maxima=True)`), Expected
Attention the probabilities of an expected query with its covariance term (`query_probs(bias=...)`,
the term in blocks of keys: `covariance_bias`), a
replay stepping through a chunk one query's row at a time (`QueryRows`), the sink map the probabilities
block by block (`probability_blocks`). The caller asks for the reduction; the kernel holds at most one
block of queries' logits at a time, within `Workspace.bytes` (64 MiB by default; `EvictingCache(...,
workspace=...)` sets it for a cache).

One query per row and head (a decode step) is one block with no loop (`query_probs`, `query_attention`).

Every tensor is grouped-query: a KV head's keys are read once by the query heads of its group, never
repeated. This package imports torch alone, so the engine (`kvevict.cache`) and the policies
(`kvevict.policies`) both stand on it.

| module | holds |
|---|---|
| `workspace.py` | `Workspace`: the bound, `rows` per block, the observer told each block's bytes |
| `one_query.py` | the single-block path: `query_probs`, `query_attention`; `covariance_bias` in blocks of keys |
| `blocks.py` | `attend` (output, sums, last row, maxima), `Mask`, `logits`, `probability_blocks`, `QueryRows` |
| `column_sums.py` | `column_sums`: summed probabilities without the probabilities, causal blocks cut short |
"""

from __future__ import annotations

from .blocks import Attended, Mask, QueryRows, attend, logits, probability_blocks, products, softmax, weighted
from .column_sums import column_sums
from .one_query import covariance_bias, query_attention, query_probs
from .workspace import DEFAULT_BYTES, Workspace

__all__ = [
    "DEFAULT_BYTES",
    "Attended",
    "Mask",
    "QueryRows",
    "Workspace",
    "attend",
    "column_sums",
    "covariance_bias",
    "logits",
    "probability_blocks",
    "products",
    "query_attention",
    "query_probs",
    "softmax",
    "weighted",
]
