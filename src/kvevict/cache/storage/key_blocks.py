"""`KeyBlocks`: keys held per channel over blocks of positions (KIVI's keys, `q4:keys=channel`).

Block `b` is the `G` positions `b*G .. (b+1)*G - 1` of the stream (`G` = the form's `key_block`). Its
scale and zero point per (row, KV head, channel) are taken once every one of its positions is older
than the residual (`done` moves to the end of the last such block), from the full-precision keys of
all `G` positions, evicted ones included: the ring keeps the latest `residual + G - 1` tokens at full
precision, which covers every position not yet in a taken block. The entries eviction leaves in a block
are encoded with its scales; a block whose entries are all gone is dropped before the next forward.
Until then a key is read at full precision (from the ring). Per slot only the key's codes are held;
the block table (`scale`, `zero` `[B, H, blocks, D]`, block numbers `ids`) is the layer's.
"""

from __future__ import annotations

import torch

from .residual_ring import read_ring


class KeyBlocks:
    def __init__(self, form, batch: int, heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        self.form, self.size = form, form.key_block
        self.done = 0  # positions below it are in taken blocks (held as codes)
        self.ids = torch.zeros(0, dtype=torch.long, device=device)  # block numbers, ascending
        self.scale = torch.zeros(batch, heads, 0, head_dim, dtype=dtype, device=device)
        self.zero = torch.zeros_like(self.scale)

    def keep_rows(self, index: torch.Tensor) -> None:
        self.scale, self.zero = self.scale.index_select(0, index), self.zero.index_select(0, index)

    def drop_empty(self, pos: torch.Tensor) -> None:
        """Drop the blocks none of the held positions `pos` `[B, H, n]` lies in (eviction emptied them)."""
        if self.ids.numel():
            live = torch.isin(self.ids, torch.unique(pos // self.size))
            if not bool(live.all()):
                self.ids, self.scale, self.zero = self.ids[live], self.scale[:, :, live], self.zero[:, :, live]

    def bytes(self, number: int) -> int:
        """The block table's scales and zero points, at `number` bytes each."""
        return 2 * self.scale.numel() * number

    def of(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The `scale` and `zero` `[B, H, m, D]` of the blocks holding positions `pos` `[B, H, m]` (any value
        where a position's block is not taken yet: the caller reads those keys from the ring)."""
        b, h, blocks, d = self.scale.shape
        if not blocks:
            ones = torch.ones(*pos.shape, d, dtype=self.scale.dtype, device=pos.device)
            return ones, torch.zeros_like(ones)
        index = torch.searchsorted(self.ids, pos // self.size).clamp(max=blocks - 1)  # [B, H, m]
        # whole rows of D numbers by one index into the flattened table (a gather of every number is slower)
        rows = (index + torch.arange(b * h, device=pos.device).view(b, h, 1) * blocks).flatten()
        scale, zero = (t.reshape(-1, d).index_select(0, rows).view(*pos.shape, d) for t in (self.scale, self.zero))
        return scale, zero

    def take(self, storage, n: int, end: int, keys: torch.Tensor, ring: torch.Tensor) -> None:
        """After a forward wrote slots `n..end-1` (their full-precision keys `keys` `[B, H, q, D]`, positions
        `seen_end - q ..`): take every block now wholly older than the residual, and encode the held slots
        in it (codes into `storage.held["kcodes"]`, their images into the keys attention reads).
        `ring`: the full-precision keys of earlier forwards `[B, H, L, D]`, position `p` in row `p % L`."""
        f, size = self.form, self.size
        ready = max(0, storage.seen_end - f.residual) // size * size
        if ready <= self.done:
            return
        start = storage.seen_end - keys.shape[2]  # the position of slot n
        pos = torch.arange(self.done, ready, device=keys.device)
        old = pos < start
        block = torch.cat([ring[:, :, pos[old] % ring.shape[2]], keys[:, :, pos[~old] - start]], dim=2)
        scale, zero = f.block_scales(block.unflatten(2, (-1, size)))  # [B, H, blocks, D]
        slots = storage.pos[:, :, :end]
        self.ids = torch.cat([self.ids, torch.arange(self.done // size, ready // size, device=keys.device)])
        self.scale = torch.cat([self.scale, scale.to(self.scale.dtype)], dim=2)
        self.zero = torch.cat([self.zero, zero.to(self.zero.dtype)], dim=2)
        taken = ((slots >= self.done) & (slots < ready))[..., None]  # [B, H, end, 1]
        held = storage._key_form()[:, :, :end]
        s, z = self.of(slots)
        codes = f.encode_keys(held, s, z)
        storage.held["kcodes"][:, :, :end] = torch.where(taken, codes, storage.held["kcodes"][:, :, :end])
        held.copy_(torch.where(taken, f.decode_keys(codes, s, z, held.dtype), held))
        self.done = ready

    def images(self, storage, count: int, ring: torch.Tensor) -> torch.Tensor:
        """The keys `[B, H, count, D]` the first `count` slots stand for: decoded from their block's
        scales, or from the ring at full precision where their block is not taken yet."""
        pos = storage.pos[:, :, :count]
        s, z = self.of(pos)
        keys = self.form.decode_keys(storage.held["kcodes"][:, :, :count], s, z, storage.dtype)
        if ring is not None and count:
            read_ring(keys, pos, ring, self.done)
        return keys
