"""Ragged storage: one layer's entries when each KV head holds its own number of them (Ada-KV).

Per row one flat buffer of `capacity` entries, keys and values in `kv` `[2, B, capacity, D]`,
original positions `pos` `[B, capacity]` (-1 where free), per-entry statistics `[B, capacity]`
float32. Each (row, KV head) owns a segment: its entries sit contiguously at
`start .. start + length`, with free room up to `limit` for the next forward's tokens.
So a head's keys are one contiguous `[length, D]` view (attention reads it as is), and
the layer allocates `KV heads x (budget + room)` entries per row, not `KV heads x` the
longest head. When a head runs out of room, the row is re-packed: segments are laid out
again with the free room shared evenly (and the buffer grown only if the row holds
more than it can). Knows nothing of policies or positions modes: it moves entries.
"""

from __future__ import annotations

import torch


class RaggedStorage:
    def __init__(
        self,
        batch: int,
        heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        stat_names: tuple[str, ...],
        per_head: int,
        room: int,
    ) -> None:
        self.batch, self.heads, self.head_dim = batch, heads, head_dim
        self.dtype, self.device = dtype, device
        self.room = room
        self.base = heads * (per_head + room)  # the capacity a row needs at its budget
        self.capacity = self.base
        self.kv = torch.zeros(2, batch, self.capacity, head_dim, dtype=dtype, device=device)
        self.pos = torch.full((batch, self.capacity), -1, dtype=torch.long, device=device)
        self.stats = {name: torch.zeros(batch, self.capacity, device=device) for name in stat_names}
        self.start = (torch.arange(heads, device=device) * (per_head + room)).expand(batch, heads).clone()
        self.limit = self.start + per_head + room
        self.length = torch.zeros(batch, heads, dtype=torch.long, device=device)

    def reset(self) -> None:
        self.length.zero_()
        self.pos.fill_(-1)
        for stat in self.stats.values():
            stat.zero_()

    def allocated(self) -> int:
        """Entries the buffers hold room for, all rows: `kv.numel() / (2 x D)`."""
        return self.kv.numel() // (2 * self.head_dim)

    def _row_base(self) -> torch.Tensor:
        return (torch.arange(self.batch, device=self.device) * self.capacity)[:, None]

    def append(self, keys: torch.Tensor, values: torch.Tensor, first: int) -> None:
        """Write `q` new entries `[B, H, q, D]` at the end of every head's segment, at
        positions `first .. first + q - 1`, statistics zeroed."""
        q = keys.shape[2]
        if bool((self.start + self.length + q > self.limit).any()):
            self.repack(q)
        steps = torch.arange(q, device=self.device)
        flat = (self._row_base()[..., None] + (self.start + self.length)[..., None] + steps).reshape(-1)
        kv = self.kv.view(2, -1, self.head_dim)
        kv[0].index_copy_(0, flat, keys.reshape(-1, self.head_dim).to(self.dtype))
        kv[1].index_copy_(0, flat, values.reshape(-1, self.head_dim).to(self.dtype))
        self.pos.view(-1).index_copy_(0, flat, (first + steps).repeat(self.batch * self.heads))
        for stat in self.stats.values():
            stat.view(-1)[flat] = 0
        self.length += q

    def padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat entry index `[B, H, L]` of each head's entries, padded to the longest head
        `L`, and which of them are held `[B, H, L]` (pads point at an entry of the row)."""
        width = max(1, int(self.length.max()))
        steps = torch.arange(width, device=self.device)
        valid = steps < self.length[..., None]
        at = torch.where(valid, self.start[..., None] + steps, 0)
        return self._row_base()[..., None] + at, valid

    def take(self, buffer: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """A per-entry buffer (`pos`, a statistic `[B, capacity]`, or `keys`) at `flat` `[B, H, L]`."""
        if buffer.dim() == 2:
            return buffer.reshape(-1)[flat]
        return buffer.reshape(-1, self.head_dim).index_select(0, flat.reshape(-1)).view(*flat.shape, -1)

    @property
    def keys(self) -> torch.Tensor:
        return self.kv[0]

    @property
    def values(self) -> torch.Tensor:
        return self.kv[1]

    def segment(self, row: int, head: int, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[length, D]` of one head's segment: views, no copy."""
        return self.kv[0, row, start : start + length], self.kv[1, row, start : start + length]

    def compact(self, keep: torch.Tensor, flat: torch.Tensor) -> None:
        """Keep the padded entries `keep` `[B, H, L]` (from `padded`'s `flat`): each head's
        kept entries move to the front of its segment, in their order."""
        width = keep.shape[-1]
        order = (~keep).to(torch.int8).argsort(dim=-1, stable=True)  # kept entries first
        src = flat.gather(-1, order)
        kept = keep.sum(dim=-1)
        moving = torch.arange(width, device=self.device) < kept[..., None]
        dst = self._row_base()[..., None] + self.start[..., None] + torch.arange(width, device=self.device)
        self._move(src[moving], dst[moving])
        freed = moving.logical_not() & (torch.arange(width, device=self.device) < self.length[..., None])
        self.pos.view(-1)[dst[freed]] = -1
        self.length = kept

    def _move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy entries `src` to `dst` (flat indices; every source is read before any write)."""
        kv = self.kv.view(2, -1, self.head_dim)
        kv.index_copy_(1, dst, kv.index_select(1, src))
        for buffer in (self.pos, *self.stats.values()):
            flat = buffer.view(-1)
            flat.index_copy_(0, dst, flat.index_select(0, src))

    def repack(self, extra: int) -> None:
        """Lay the segments out again so every head has room for `extra` more entries, the
        free room shared evenly; the buffer grows (or shrinks back to `base`) to fit."""
        need = self.length + extra  # [B, H]
        most = int(need.sum(dim=-1).max())
        capacity = self.base if most <= self.base else most + self.heads * self.room  # grow only past `base`
        share = (capacity - need.sum(dim=-1, keepdim=True)) // self.heads  # [B, 1]
        size = need + share
        start = size.cumsum(dim=-1) - size
        old_flat, valid = self.padded()
        old_pos = self.take(self.pos, old_flat)
        old_stats = {name: self.take(stat, old_flat) for name, stat in self.stats.items()}
        old_kv = self.kv.view(2, -1, self.head_dim).index_select(1, old_flat.reshape(-1))
        if capacity != self.capacity:
            self.capacity = capacity
            self.kv = torch.zeros(2, self.batch, capacity, self.head_dim, dtype=self.dtype, device=self.device)
            self.pos = torch.full((self.batch, capacity), -1, dtype=torch.long, device=self.device)
            self.stats = {name: torch.zeros(self.batch, capacity, device=self.device) for name in self.stats}
        else:
            self.pos.fill_(-1)
        width = valid.shape[-1]
        dst = self._row_base()[..., None] + start[..., None] + torch.arange(width, device=self.device)
        where = valid.reshape(-1)
        dst = dst.reshape(-1)[where]
        self.kv.view(2, -1, self.head_dim).index_copy_(1, dst, old_kv[:, where])
        self.pos.view(-1)[dst] = old_pos.reshape(-1)[where]
        for name, stat in self.stats.items():
            stat.view(-1)[dst] = old_stats[name].reshape(-1)[where]
        self.start, self.limit = start, start + size
