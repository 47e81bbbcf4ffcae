"""Per-head budgets (Ada-KV, `adakv:P`): layers whose KV heads hold different numbers of entries.

| module | owns |
|---|---|
| `layer.py` | `RaggedLayer`: `KV heads x budget` entries per row; all rows and heads attend at once, masked |
| `attention.py` | `ragged_attention`: every row and head at once, each query group over its own head's entries |
| `storage.py` | `RaggedStorage`: per (row, KV head) a segment of one flat buffer; evictions leave holes |
| `allocation.py` | `allocate`: which entries survive when the heads share the allowance |

The cache swaps these layers in through `PER_HEAD_KINDS` when a batch's policy
declares `varies_by_head`; nothing else in the engine names them.
"""

from .layer import RaggedLayer

#: the layer class of a kind when the batch's policies give each KV head its own budget (`adakv:P`)
PER_HEAD_KINDS = {"full_attention": RaggedLayer}

__all__ = ["PER_HEAD_KINDS", "RaggedLayer"]
