"""The most recent queries of one layer: SnapKV's observation window, across forwards.

SnapKV scores cached entries by the attention the last `window` queries pay them. In a
stream those queries arrive one forward at a time, so the cache keeps them: a circular
buffer holding each query as attention used it, the position it was rotated at and its
position in the stream. Storing them already rotated means a decode step costs one slot
write; they are re-rotated only when read, and only if their tokens have moved since
(position-shift mode), never in original-position mode.
"""

from __future__ import annotations

import torch


class QueryWindow:
    def __init__(self, size: int) -> None:
        self.size = size
        self.queries: torch.Tensor | None = None  # [B, H_q, size, D]
        self.used: torch.Tensor | None = None  # [size] positions the queries were rotated at
        self.stream: torch.Tensor | None = None  # [size] stream positions of their tokens
        self.count = 0  # queries ever written

    def remember(self, query: torch.Tensor, used: torch.Tensor, seen: int) -> None:
        """Write the last queries of a forward; `seen` counts tokens including this forward's."""
        if self.queries is None:
            b, h, _, d = query.shape
            self.queries = query.new_zeros(b, h, self.size, d)
            self.used = torch.full((self.size,), -1, dtype=torch.long, device=query.device)
            self.stream = torch.full((self.size,), -1, dtype=torch.long, device=query.device)
        count = min(self.size, query.shape[2])
        if count == 1:
            slot = self.count % self.size
            self.queries[:, :, slot] = query[:, :, -1]
            self.used[slot] = used[-1]
            self.stream[slot] = seen - 1
        else:
            slots = (self.count + torch.arange(count, device=query.device)) % self.size
            self.queries[:, :, slots] = query[:, :, -count:]
            self.used[slots] = used[-count:]
            self.stream[slots] = torch.arange(seen - count, seen, device=query.device)
        self.count += count

    def last(self, size: int, seen: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The last `size` queries (in buffer order), their rotation positions and stream positions."""
        held = min(self.count, self.size)
        if size >= held:
            return self.queries[:, :, :held], self.used[:held], self.stream[:held]
        slots = torch.nonzero(self.stream >= seen - size).flatten()
        return self.queries[:, :, slots], self.used[slots], self.stream[slots]
