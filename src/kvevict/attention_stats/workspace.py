"""`Workspace`: the most memory one block of attention logits may hold, and who is told each block's size.

Attention statistics are reductions of `softmax(Q K^T)` (column sums, a last row, column maxima, an
output). A prefill of `m` queries over `n` keys would hold `B x H_q x m x n` float32 logits at once,
which grows with the square of a long context. The kernel never does: it takes the queries in blocks
of `rows` queries, `rows` chosen so that one block's logits, `B x H_q x rows x n x 4` bytes, stay
within `Workspace.bytes`. A block holds a few tensors of that size at once (the logits, the
probabilities softmax makes of them, a bool mask), so the memory in flight is a small multiple of the
bound, never a function of `m`. A block is never less than one query: the bound holds wherever one
query's row (`B x H_q x n x 4` bytes: 16 MiB at 32 query heads and 128K keys) fits in it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

#: the default bound: 64 MiB of float32 logits (2^24 of them) per block of queries
DEFAULT_BYTES = 64 << 20
#: bytes of one logit: the kernel widens logits to float32 before the softmax, whatever the model's dtype
LOGIT_BYTES = 4


@dataclass(frozen=True)
class Workspace:
    """The bytes of float32 logits one block of queries may hold (`bytes`), and an optional `observe`
    told the bytes of every block the kernel materialises (a test or a profile reads the largest; the
    kernel keeps no record of its own). A copy of a cache shares its workspace: the same bound, the
    same observer."""

    bytes: int = DEFAULT_BYTES
    observe: Callable[[int], None] | None = None

    def rows(self, per_query: int, cap: int | None = None) -> int:
        """Queries per block when one query's logits are `per_query` elements: as many as stay within the
        bound, at least one, at most `cap` (None: no cap)."""
        rows = max(1, self.bytes // (LOGIT_BYTES * max(1, per_query)))
        return rows if cap is None else min(rows, cap)

    def held(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits`, after telling the observer their bytes."""
        if self.observe is not None:
            self.observe(logits.numel() * logits.element_size())
        return logits

    def __deepcopy__(self, memo: dict) -> Workspace:
        return self  # frozen, and its observer is the caller's: a copied cache reports to the same one
