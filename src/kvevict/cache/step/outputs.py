"""`StepOutputs`: a chunk's attention outputs, step by step, written into one tensor.

A chunk that evicts token by token attends one query per step (the per-head layer's steps, the
position-shift mode's stepping). Each step makes temporaries the size of the held entries (its logits,
its rotated keys: 4 MB and 17 MB per step at Llama-3.1-8B's attention shape and 4,096 entries) and
returns a small output. Kept in a list to the chunk's end, the outputs are small live blocks that the
allocator places after each step's temporaries, so the heap can neither reuse those nor give them back:
at that shape Ada-KV's stream reached a high-water mark 760 MB above its start inside one chunk, in
chunks that differed from run to run (docs/benchmarks.md, `benchmarks/stream_memory_trace.py`). Written
into one tensor made at the first step, nothing of a step outlives it but its share of that tensor.
"""

from __future__ import annotations

import torch


class StepOutputs:
    """The outputs of a chunk's `q` queries `[B, H_q, q, D]`, `put` in order a step (or a span of steps) at a time."""

    def __init__(self, q: int) -> None:
        self.q = q
        self.out: torch.Tensor | None = None

    def put(self, i: int, out: torch.Tensor) -> None:
        """The output `[B, H_q, m, D]` of queries `i .. i + m - 1`; the first sets the whole tensor's shape, dtype
        and device (a span of every query is kept as it is)."""
        if self.out is None:
            if out.shape[2] == self.q:
                self.out = out
                return
            self.out = out.new_empty((*out.shape[:2], self.q, out.shape[3]))
        self.out[:, :, i:i + out.shape[2]] = out
