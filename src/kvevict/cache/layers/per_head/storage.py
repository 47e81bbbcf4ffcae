"""Ragged storage: one layer's entries when each KV head holds its own number of them (Ada-KV).

Per row one flat buffer of `capacity` entries, keys and values in `kv` `[2, B, capacity, D]`,
original positions `pos` `[B, capacity]` (-1 where nothing is held), per-entry statistics
`[B, capacity]` float32. Each (row, KV head) owns a segment `start .. limit` of the row:
new tokens go at its `tail` (flat index), and an evicted entry only has its position set to -1
(a hole), so a decode step moves no keys. A head's entries stay in positional order in
its segment. When a head reaches its limit the row is re-packed: the held entries move
to the front of their segments and the free room is shared evenly again (the buffer
grows only if the row holds more than it can). So the layer allocates
`KV heads x (budget + room)` entries per row, not `KV heads x` the longest head.

`owner` `[B, capacity]` names the head each entry's segment belongs to, so a per-entry
buffer reads as a per-head one by masking (`members`): attention and the policies see
every head of a row at once, with the padding in the compute and none in the storage.
Knows nothing of policies or positions modes: it moves entries.
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
        self.room, self.stat_names = room, tuple(stat_names)
        self.rebase(per_head)
        self._allocate(self.base)
        start = (torch.arange(heads, device=device) * (per_head + room)).expand(batch, heads).clone()
        self._lay_out(start, start + per_head + room)
        self.held = torch.zeros(batch, heads, dtype=torch.long, device=device)  # [B, H] entries held
        self.most_held = 0  # entries the fullest row holds (a Python int: no sync to read it)
        self._rewind()

    def rebase(self, per_head: int) -> None:
        """The capacity a row needs at a budget of `per_head` entries per head (the next `repack`
        lays the buffer out for it): a state read once and compressed at several budgets."""
        self.base = self.heads * (per_head + self.room)

    def _allocate(self, capacity: int) -> None:
        self.capacity = capacity
        self.kv = torch.zeros(2, self.batch, capacity, self.head_dim, dtype=self.dtype, device=self.device)
        self.pos = torch.full((self.batch, capacity), -1, dtype=torch.long, device=self.device)
        self.stats = {name: torch.zeros(self.batch, capacity, dtype=torch.float32, device=self.device)
                      for name in self.stat_names}

    def _lay_out(self, start: torch.Tensor, limit: torch.Tensor) -> None:
        """Segments `start .. limit` `[B, H]` (ascending by head); `owner` and `own` follow them."""
        self.start, self.limit = start, limit
        at = torch.arange(self.capacity, device=self.device).expand(self.batch, -1).contiguous()
        self.owner = (torch.searchsorted(start, at, right=True) - 1).clamp(min=0)  # [B, capacity]
        self.own = self.owner[:, None, :] == torch.arange(self.heads, device=self.device)[None, :, None]
        size, rest = divmod(self.capacity, self.heads)
        even = torch.arange(self.heads, device=self.device) * size
        self.segment = size if rest == 0 and bool((start == even).all() & (limit == even + size).all()) else None

    def _rewind(self, used: torch.Tensor | None = None) -> None:
        """Each head's next free slot after its first `used` `[B, H]` slots (none by default)."""
        row_base = torch.arange(self.batch, device=self.device)[:, None] * self.capacity
        self.tail = row_base + self.start + (used if used is not None else 0)  # [B, H] flat index
        self.room_left = int((row_base + self.limit - self.tail).min())  # every head advances alike

    def filled(self) -> torch.Tensor:
        """`[B, H]` the slots each head has written in its segment, held or holes."""
        row_base = torch.arange(self.batch, device=self.device)[:, None] * self.capacity
        return self.tail - row_base - self.start

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keep only the rows `index` `[b]` (in that order): a batch whose other rows are done."""
        used = self.filled().index_select(0, index)
        self.kv = self.kv.index_select(1, index)
        self.pos = self.pos.index_select(0, index)
        self.stats = {name: stat.index_select(0, index) for name, stat in self.stats.items()}
        self.held = self.held.index_select(0, index)
        self.batch = index.numel()
        self._lay_out(self.start.index_select(0, index), self.limit.index_select(0, index))
        self._rewind(used)
        self.most_held = int(self.held.sum(dim=-1).max())

    def reset(self) -> None:
        self.held.zero_()
        self.most_held = 0
        self._rewind()
        self.pos.fill_(-1)
        for stat in self.stats.values():
            stat.zero_()

    def allocated(self) -> int:
        """Entries the buffers hold room for, all rows: `kv.numel() / (2 x D)`."""
        return self.kv.numel() // (2 * self.head_dim)

    def held_bytes(self, entries: int, full_bytes: int | None = None) -> int:
        """Bytes held for `entries` keys and values (the storage-form seam, `SlotStorage.held_bytes`)."""
        return entries * 2 * self.head_dim * (full_bytes or self.kv.element_size())

    def allocated_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @property
    def keys(self) -> torch.Tensor:
        """`[B, capacity, D]`, every head's segment of a row in one buffer."""
        return self.kv[0]

    @property
    def values(self) -> torch.Tensor:
        return self.kv[1]

    def members(self) -> torch.Tensor:
        """`[B, H, capacity]` bool: the entries each head holds (its segment, not a hole)."""
        return self.own & (self.pos >= 0)[:, None, :]

    def own_segments(self, per_head: torch.Tensor) -> torch.Tensor:
        """`[b, H, segment, ...]` each head's own segment of a per-head buffer `[b, H, capacity, ...]` (a view),
        where the layout is `segment`'s."""
        b, h = per_head.shape[:2]
        lanes = per_head.view(b, h, h, self.segment, *per_head.shape[3:])
        return lanes.diagonal(dim1=1, dim2=2).movedim(-1, 1)

    def spread(self, segments: torch.Tensor) -> torch.Tensor:
        """`[b, H, capacity]` from each head's value over its own segment `[b, H, segment]`: zero over the
        other heads' entries, as a head's queries give them no attention."""
        b, h, size = segments.shape
        out = segments.new_zeros(b, h, h, size)
        out.diagonal(dim1=1, dim2=2).copy_(segments.movedim(1, 2))
        return out.view(b, h, h * size)

    def per_head(self, buffer: torch.Tensor, hidden: torch.Tensor, fill: float | int) -> torch.Tensor:
        """A per-entry buffer `[b, capacity]` as each head sees it `[b, H, capacity]`: `fill`
        where the head holds nothing (`hidden`, the negation of `members`)."""
        return buffer[:, None, :].expand(-1, self.heads, -1).masked_fill(hidden, fill)

    def append(self, keys: torch.Tensor, values: torch.Tensor, first: int, room: int = 0) -> None:
        """Write `q` new entries `[B, H, q, D]` at the end of every head's segment, at
        positions `first .. first + q - 1`, statistics zeroed. Segments without room for `room` entries
        more (a chunked prefill's whole context, `CacheLayer.reserved`; at least `q`) are re-packed with it:
        a growth copies every held entry and holds the old buffer beside the new, so one that reserves grows
        while it holds nothing."""
        q, room = keys.shape[2], max(keys.shape[2], room)
        if room > self.room_left:
            self.repack(room)
        kv = self.kv.view(2, -1, self.head_dim)
        if q == 1:  # a decode step: one slot per head, all at position `first`
            flat = self.tail.view(-1)
            self.pos.view(-1).index_fill_(0, flat, first)
        else:
            steps = torch.arange(q, device=self.device)
            flat = (self.tail[..., None] + steps).reshape(-1)
            self.pos.view(-1).index_copy_(0, flat, (first + steps).repeat(self.batch * self.heads))
        kv[0].index_copy_(0, flat, keys.reshape(-1, self.head_dim).to(self.dtype))
        kv[1].index_copy_(0, flat, values.reshape(-1, self.head_dim).to(self.dtype))
        for stat in self.stats.values():
            stat.view(-1).index_fill_(0, flat, 0.0)
        self.tail = self.tail + q
        self.room_left -= q
        self.held += q
        self.most_held += self.heads * q

    def dense(self) -> int | None:
        """The entries every head holds where each head of every row holds the same number as the first slots
        of its own equal segment, with no hole among them (a prefill, a held-back one, KVzip's repeat forwards
        over it): then the buffer reads as a plain cache `[B, H, n, D]`, and attention needs no mask but the
        causal one. None otherwise. One read of the device (call it once per forward of many tokens)."""
        if self.segment is None:
            return None
        written = self.filled()
        n = self.held.view(-1)[:1]
        return int(n) if bool(((self.held == written) & (self.held == n)).all()) else None

    def drop_latest(self, count: int) -> None:
        """Free the last `count` slots each head wrote, which the caller knows hold its latest `count` tokens
        (`RaggedLayer.crop`): they are written again next, so a repeat forward taken back out leaves no holes
        and uses up no room."""
        back = torch.arange(1, count + 1, device=self.device)
        self.pos.view(-1).index_fill_(0, (self.tail[..., None] - back).reshape(-1), -1)
        self.tail = self.tail - count
        self.room_left += count
        self.held -= count
        self.most_held -= self.heads * count

    def evict(self, keep: torch.Tensor, most: int) -> None:
        """Keep the entries `keep` `[B, H, capacity]` (a subset of `members`); the others become
        holes. `most`: what the fullest row holds after it (the caller knows: its allowance)."""
        self.pos.masked_fill_(~keep.any(dim=1), -1)
        self.held = keep.sum(dim=-1)
        self.most_held = most

    def first_slots(self) -> torch.Tensor:
        """`[B, H, 1]` the position in the first slot of each head's segment: its earliest held
        token if that slot is held (segments hold their entries in positional order, and
        nothing is written before a segment's start), else -1 or a later token. So token 0
        is held by a head exactly when this is 0."""
        first = self.pos.gather(1, self.start)  # an empty segment may start where the next one does
        return first.masked_fill(self.held == 0, -1)[..., None]

    def repack(self, extra: int) -> None:
        """Lay the segments out again so every head has room for `extra` more entries, the
        free room shared evenly; the held entries move to the front of their segments, in
        order, and the buffer grows (or shrinks back to `base`) to fit."""
        need = self.held + extra  # [B, H]
        most = int(need.sum(dim=-1).max())
        capacity = self.base if most <= self.base else most + self.heads * self.room  # grow only past `base`
        share = (capacity - need.sum(dim=-1, keepdim=True)) // self.heads  # [B, 1]
        size = need + share
        start = size.cumsum(dim=-1) - size
        held = self.pos >= 0  # [B, capacity]
        # an entry's place among its head's held entries, counted along the row
        before = held.long().cumsum(dim=-1) - 1  # held entries of the row before it
        head_first = self.held.cumsum(dim=-1) - self.held  # [B, H] held entries of the heads before
        rank = before - head_first.gather(1, self.owner)
        dst = start.gather(1, self.owner) + rank  # [B, capacity] its slot in the new layout
        rows = torch.arange(self.batch, device=self.device)[:, None] * capacity
        src_rows = torch.arange(self.batch, device=self.device)[:, None] * self.capacity
        src = (src_rows + torch.arange(self.capacity, device=self.device))[held]
        dst = (rows + dst)[held]
        old_kv = self.kv.view(2, -1, self.head_dim).index_select(1, src)
        old_pos = self.pos.view(-1).index_select(0, src)
        old_stats = {name: stat.view(-1).index_select(0, src) for name, stat in self.stats.items()}
        if capacity != self.capacity:
            self._allocate(capacity)
        else:
            self.pos.fill_(-1)
        self.kv.view(2, -1, self.head_dim).index_copy_(1, dst, old_kv)
        self.pos.view(-1).index_copy_(0, dst, old_pos)
        for name, stat in self.stats.items():
            stat.view(-1).index_copy_(0, dst, old_stats[name])
        self._lay_out(start, start + size)
        self._rewind(self.held)
