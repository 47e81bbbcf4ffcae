"""Slot storage: one layer's preallocated buffers, written in place, gathered on eviction.

Per (row, KV head) there are `capacity` slots; slots `0..n-1` hold the kept entries and
a forward's new tokens go right after them. Keys and values share one buffer
`kv` `[2, B, H, capacity, D]` so a decode step moves a slot of both with one copy.
Beside them: original positions `pos` `[B, H, capacity]`, the policies' per-slot
statistics, and optionally the un-rotated keys `raw` (position-shift mode).

Dtypes: `kv` and `raw` are held in the dtype of the keys the layer first receives (the
model's: bf16 keys are stored in bf16, and `kv_bytes` counts 2 bytes per element); the
statistics (H2O's and TOVA's cumulative attention, SnapKV's pooled window, k-norm's norms)
are always float32 (`cache/statistics/probabilities.py` says why), whatever the model's dtype.
The storage knows nothing of policies, positions modes or metrics: it moves slots.

This class holds entries at the model's dtype. Another storage form (`quantized.py`: packed codes)
subclasses it and answers the same seam: `begin` (before a forward writes), `written` (after its new
entries are stored), `release` (after the forward), `held_bytes` / `allocated_bytes` (what it holds).
"""

from __future__ import annotations

import torch


class SlotStorage:
    def __init__(
        self,
        batch: int,
        heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        stat_names: tuple[str, ...],
        raw_keys: bool,
        capacity: int,
    ) -> None:
        self.batch, self.heads, self.head_dim = batch, heads, head_dim
        self.dtype, self.device = dtype, device
        self.stat_names = stat_names
        self.raw_keys = raw_keys
        self.capacity = 0
        #: statistics the layer writes for every new slot itself (`open` need not zero them)
        self.written_on_arrival: frozenset[str] = frozenset()
        self.raw: torch.Tensor | None = None
        self.stats: dict[str, torch.Tensor] = {}
        self._allocate(capacity, 0)

    def _allocate(self, capacity: int, n: int) -> None:
        """(Re)allocate for `capacity` slots, carrying the first `n` over."""
        shape = (self.batch, self.heads, capacity)
        old = (self.kv, self.raw, self.pos, self.stats) if self.capacity else None
        self.kv = torch.zeros(2, *shape, self.head_dim, dtype=self.dtype, device=self.device)
        self.keys, self.values = self.kv[0], self.kv[1]
        self.raw = torch.zeros_like(self.keys) if self.raw_keys else None
        self.pos = torch.zeros(shape, dtype=torch.long, device=self.device)
        self.stats = {name: torch.zeros(shape, dtype=torch.float32, device=self.device) for name in self.stat_names}
        if old is not None and n:
            self.kv[:, :, :, :n] = old[0][:, :, :, :n]
            if self.raw is not None:
                self.raw[:, :, :n] = old[1][:, :, :n]
            self.pos[:, :, :n] = old[2][:, :, :n]
            for name, stat in self.stats.items():
                stat[:, :, :n] = old[3][name][:, :, :n]
        self.capacity = capacity
        self._index_cells()

    def _index_cells(self) -> None:
        # Offset of each (row, head) in the flattened [B*H*capacity] slots (`gather`).
        cells = torch.arange(self.batch * self.heads, device=self.device)
        self.row_base = (cells * self.capacity).view(self.batch, self.heads)

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keep only the rows `index` `[b]` (in that order): a batch whose other rows are done."""
        self.kv = self.kv.index_select(1, index)
        self.keys, self.values = self.kv[0], self.kv[1]
        if self.raw is not None:
            self.raw = self.raw.index_select(0, index)
        self.pos = self.pos.index_select(0, index)
        self.stats = {name: stat.index_select(0, index) for name, stat in self.stats.items()}
        self.batch = index.numel()
        self._index_cells()

    def ensure(self, needed: int, n: int, grow_to: int) -> None:
        """Make room for `needed` slots (keeping the first `n`), growing to `grow_to` at least."""
        if needed > self.capacity:
            self._allocate(max(needed, grow_to), n)

    def fit(self, capacity: int, n: int) -> bool:
        """Give back buffers far larger than needed: when more than twice `capacity` slots are
        allocated (a long forward grew them, then evicted), copy the first `n` into buffers of
        `capacity` slots. Returns whether it did. Twice, so a stream of chunks that each
        outgrow the room does not reallocate at every chunk for a few slots."""
        if self.capacity <= 2 * capacity or n > capacity:
            return False
        self._allocate(capacity, n)
        return True

    def open(self, n: int, values: torch.Tensor, seen: int) -> None:
        """Write a forward's `q` new entries into slots `n..n+q-1`: values, positions from
        `seen` on, zeroed statistics. Keys are written by the position mode."""
        q = values.shape[2]
        end = n + q
        if q == 1:
            self.pos[:, :, n].fill_(seen)
        else:
            self.pos[:, :, n:end] = torch.arange(seen, seen + q, device=self.device)
        for name, stat in self.stats.items():
            if name not in self.written_on_arrival:
                stat[:, :, n:end] = 0
        self.values[:, :, n:end] = values

    def fill_hole(self, victim: torch.Tensor, newest: int) -> None:
        """Move slot `newest` into each `[B, H]` victim slot: one `scatter_` per buffer.

        Nothing else moves, so slots stop being in positional order. The source is a view of slot
        `newest`, read where it lies: a (row, head) whose victim is the newest slot writes each element
        onto itself with its own value, and no other element read is written, so the order of reads and
        writes cannot change the result. Where the view is one dense block (one row, one KV head) torch
        sees it overlap the buffer and refuses it: that one is copied first.
        """
        at = victim[..., None]  # [B, H, 1]
        source = self.kv.narrow(3, newest, 1)
        source = source.clone() if source.is_contiguous() else source
        self.kv.scatter_(3, at[None, ..., None].expand(2, *at.shape, self.head_dim), source)
        for buffer in self._per_slot():
            source = buffer.narrow(2, newest, 1)
            source = source.clone() if source.is_contiguous() else source
            if buffer.dim() == 3:
                buffer.scatter_(2, at, source)
            else:  # per-slot vectors: un-rotated keys, a storage form's codes
                buffer.scatter_(2, at[..., None].expand(*at.shape, buffer.shape[3]), source)

    # --- the storage-form seam: no-ops for entries held as they are --------------------------------
    def begin(self, n: int, q: int, seen_end: int) -> None:
        """Before a forward writes `q` entries after the `n` held (`seen_end`: tokens seen after it)."""

    def written(self, n: int, end: int) -> bool:
        """The forward's entries sit in slots `n..end-1`. Returns whether the position mode must rebuild the
        rotated keys from `raw` (a storage form that changed what `raw` holds)."""
        return False

    def release(self) -> None:
        """After a forward: drop working buffers the held form does not need."""

    def held_bytes(self, entries: int, full_bytes: int | None = None) -> int:
        """Bytes held for `entries` keys and values (summed over rows and heads), at the buffers' dtype or,
        given `full_bytes`, at that many bytes per number (2: bf16)."""
        return entries * 2 * self.head_dim * (full_bytes or self.kv.element_size())

    def allocated_bytes(self) -> int:
        """Bytes of the key and value buffers, every slot included."""
        return self.kv.numel() * self.kv.element_size()

    def move_slot(self, source: int, dest: int) -> torch.Tensor:
        """Move slot `source` into slot `dest` for every (row, head): the one victim of a decode step
        whose slot is known ahead (a first-in-first-out policy). Returns the positions `[B, H]`
        that slot `dest` held (a view of a fresh copy)."""
        gone = self.pos[:, :, dest].clone()
        self.kv[:, :, :, dest] = self.kv[:, :, :, source]
        for buffer in self._per_slot():
            buffer[:, :, dest] = buffer[:, :, source]
        return gone

    def _per_slot(self) -> list[torch.Tensor]:
        """Per-slot buffers besides keys and values: positions, statistics, un-rotated keys."""
        extra = [self.raw] if self.raw is not None else []
        return [self.pos, *self.stats.values(), *extra]

    def gather(self, keep: torch.Tensor, keys: bool = True) -> None:
        """Move the slots `keep` `[B, H, k]` to the front, in that order.

        `keys=False` leaves the keys for the caller to rebuild (position-shift mode
        re-rotates them from `raw`).
        """
        count = keep.shape[-1]
        # One flat row index into [B*H*capacity] for every kept slot: index_select on
        # contiguous rows is ~100x faster on CPU than gather with an expanded index.
        flat = (keep + self.row_base[..., None]).reshape(-1)

        def take(buffer: torch.Tensor) -> torch.Tensor:
            rows = buffer.reshape(self.batch * self.heads * self.capacity, -1).index_select(0, flat)
            return rows.view(self.batch, self.heads, count, *buffer.shape[3:])

        self.values[:, :, :count] = take(self.values)
        for buffer in self._per_slot():
            buffer[:, :, :count] = take(buffer)
        if keys:
            self.keys[:, :, :count] = take(self.keys)

