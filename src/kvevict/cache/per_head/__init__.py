"""Per-head budgets (Ada-KV, `adakv:P`): layers whose KV heads hold different numbers of entries.

| module | owns |
|---|---|
| `layer.py` | `RaggedLayer`: one allowance of `KV heads x budget` per row, attention by hand per (row, KV head) |
| `storage.py` | `RaggedStorage`: per (row, KV head) a contiguous segment of one flat buffer, with room to grow |
| `allocation.py` | `allocate`: which entries survive when the heads share the allowance |

The cache swaps these layers in through `PER_HEAD_KINDS` when a batch's policy
declares `varies_by_head`; nothing else in the engine names them.
"""

from .layer import RaggedLayer

#: the layer class of a kind when the batch's policies give each KV head its own budget (`adakv:P`)
PER_HEAD_KINDS = {"full_attention": RaggedLayer}

__all__ = ["PER_HEAD_KINDS", "RaggedLayer"]
