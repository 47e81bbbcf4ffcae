"""`QuantizedStorage`: a layer's slots held in a storage form (codes), a full-precision residual beside them.

The one storage behind `SlotStorage`'s seam (`begin`, `written`, `release`, `held_bytes`) for every
registered form (`storage_forms.FORMS`: `q8`/`q4`/`q2` integer codes, `fp8`): the layer, the policies
and the replay see the same slot buffers as ever, `kv` `[2, B, H, capacity, D]`, but here that buffer
is a working copy that lives for one forward only:

* **held between forwards**, per slot: the key's and the value's parts as the form declares them
  (`StorageForm.parts`: for `q4` the packed codes, uint8 `[B, H, capacity, D * bits / 8]`, and the
  scales and zero points, `[B, H, capacity, D / group]` at the model's dtype; for `fp8` the D float8
  codes; a part's keys and values in one tensor, `sides`), moved with their slot by every gather, hole
  fill and ring turn, like the positions; the form's own numbers that are not per slot (`state`: fp8's
  scales); and a ring of the `residual` most recent tokens' keys and values at full precision
  (`[2, B, H, residual, D]`, token `p` in row `p % residual`). All are counted by `held_bytes`.
* **in a forward**: `begin` decodes the held parts into `kv` (`StorageForm.decode_into`), lent by the
  cache's one working buffer (`working.py`: the layers take turns in it), and puts back, from the
  ring, the entries still among the `residual` most recent tokens at the forward's end; `written`
  encodes the forward's new entries once (`StorageForm.encode`) and leaves attention their images
  (the latest `residual` of them at full precision); `release` drops `kv` and gives the buffer back
  when the layer is done with the forward (the layer's `fit_storage`).

So attention, and every policy that scores by attention or keys, reads exactly the decoded entries.
Encoding is per entry (given the form's calibrated state), so an entry's codes do not depend on when
or beside what it was encoded: a chunk equals its tokens one by one at residual 0. In position-shift
mode the un-rotated keys `raw` are what is held; the position mode rotates their images to their
slots (`written` answers that the keys need it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from ...errors import KvevictError
from ...storage_forms import StorageForm
from .key_blocks import KeyBlocks
from .residual_ring import read_ring
from .slots import SlotStorage
from .working import WorkingBuffer


class QuantizedStorage(SlotStorage):
    """Slots held in a storage form (see the module docstring); `form` is the policies' `StorageForm`."""

    def __init__(self, *args, form: StorageForm, working: WorkingBuffer | None = None, **kwargs) -> None:
        self.form = form
        self.working = working  # the cache's one buffer its layers decode into in a forward (`working.py`)
        self.parts: dict[str, tuple[int, torch.dtype]] = {}  # per slot, of keys and of values alike
        self.state: dict = {}  # the form's numbers that are not per slot (fp8's scales)
        self._kv: torch.Tensor | None = None
        self._raw: torch.Tensor | None = None
        # per part name, `[sides, B, H, capacity, width]`: the keys' (when held alike) and the values' parts in
        # one tensor, so that a decode reads both sides without stacking them (`_decode`)
        self.sides: dict[str, torch.Tensor] = {}
        self.own_keys: dict[str, torch.Tensor] = {}  # keys' parts held apart (by blocks: their codes alone)
        self.held: dict[str, torch.Tensor] = {}  # every part by side and name (`_hold`)
        self.ring: torch.Tensor | None = None
        # full-precision tokens the ring keeps: the residual, and keys of blocks not taken yet (`key_blocks.py`)
        self.ring_len = form.residual + max(form.key_block - 1, 0)
        self.blocks: KeyBlocks | None = None
        self.seen_end = 0  # tokens seen at the end of the forward in flight (the residual's reference)
        super().__init__(*args, **kwargs)

    # --- the working buffers, rebuilt from the held codes whenever read after `release` ---------------
    @property
    def kv(self) -> torch.Tensor:
        if self._kv is None:
            self._materialize(self.capacity)
        return self._kv

    @kv.setter
    def kv(self, value: torch.Tensor) -> None:
        self._give_back()  # a slot move made a buffer of its own (growth, rows kept): the lent one goes back
        self._kv = value

    @property
    def keys(self) -> torch.Tensor:
        return self.kv[0]

    @keys.setter
    def keys(self, value) -> None:
        pass  # always a view of `kv`

    @property
    def values(self) -> torch.Tensor:
        return self.kv[1]

    @values.setter
    def values(self, value) -> None:
        pass

    @property
    def raw(self) -> torch.Tensor | None:
        if self.raw_keys and self._raw is None:
            self._materialize(self.capacity)
        return self._raw

    @raw.setter
    def raw(self, value: torch.Tensor | None) -> None:
        self._raw = value

    def _key_form(self) -> torch.Tensor:
        """The keys as held: un-rotated (position shift) or as the model rotated them."""
        return self._raw if self.raw_keys else self._kv[0]

    # --- allocation and slot moves: the held buffers go wherever a slot goes -------------------------
    def _allocate(self, capacity: int, n: int) -> None:
        old = (self.sides, self.own_keys) if self.capacity else None
        super()._allocate(capacity, n)
        shape = (self.batch, self.heads, capacity)
        d, f = self.head_dim, self.form
        self.parts = f.parts(d, self.dtype)
        stacked = 1 if f.key_block else 2  # keys by their blocks hold parts of their own (`key_blocks.py`)
        self.sides = {name: torch.zeros(stacked, *shape, width, dtype=dtype, device=self.device)
                      for name, (width, dtype) in self.parts.items()}
        self.own_keys = {} if stacked == 2 else {
            "k" + name: torch.zeros(*shape, width, dtype=dtype, device=self.device)
            for name, (width, dtype) in f.key_parts(d, self.dtype).items()}
        if old is not None and n:
            for name, side in self.sides.items():
                side[:, :, :, :n] = old[0][name][:, :, :, :n]
            for name, part in self.own_keys.items():
                part[:, :, :n] = old[1][name][:, :, :n]
        self._hold()
        if self.ring is None and self.ring_len:
            self.ring = torch.zeros(2, self.batch, self.heads, self.ring_len, d, dtype=self.dtype, device=self.device)
        if self.blocks is None and f.key_block:
            self.blocks = KeyBlocks(f, self.batch, self.heads, d, self.dtype, self.device)

    def _hold(self) -> None:
        """`held`: every per-slot part by side and name (`kcodes`, `vscale`, ...), `[B, H, capacity, width]`:
        views of `sides` (the keys' too, where they are held alike) and the keys' own parts (`own_keys`)."""
        self.held = dict(self.own_keys)
        for name, side in self.sides.items():
            if side.shape[0] == 2:
                self.held["k" + name] = side[0]
            self.held["v" + name] = side[-1]

    def _per_slot(self) -> list[torch.Tensor]:
        return [*super()._per_slot(), *self.held.values()]

    def keep_rows(self, index: torch.Tensor) -> None:
        super().keep_rows(index)
        self.sides = {name: side.index_select(1, index) for name, side in self.sides.items()}
        self.own_keys = {name: part.index_select(0, index) for name, part in self.own_keys.items()}
        self._hold()
        if self.ring is not None:
            self.ring = self.ring.index_select(1, index)
        if self.blocks is not None:
            self.blocks.keep_rows(index)

    # --- the seam ----------------------------------------------------------------------------------
    def begin(self, n: int, q: int, seen_end: int) -> None:
        """Before a forward writes `q` entries after the `n` held: dequantize what is held."""
        self.seen_end = seen_end
        if self.blocks is not None:
            self.blocks.drop_empty(self.pos[:, :, :n])
        self._materialize(n, lend=True)

    def written(self, n: int, end: int) -> bool:
        """Encode the entries just written to slots `n..end-1` (once), leave their images for attention
        and keep the latest `residual` at full precision. Returns whether the rotated keys must be
        rebuilt from `raw` (position shift)."""
        f = self.form
        keys, values = self._key_form()[:, :, n:end], self._kv[1][:, :, n:end]  # [B, H, q, D]
        full = torch.stack([keys, values])  # [2, B, H, q, D]: one call encodes both
        if self.blocks is not None:
            return self._written_by_blocks(n, end, full)
        held = f.encode(full, self.state)
        for name, side in self.sides.items():
            side[:, :, :, n:end] = held[name]
        images = f.decode(held, self.dtype, self.state)
        keys.copy_(images[0])
        values.copy_(images[1])
        if f.residual:
            fresh = min(end - n, f.residual)  # the latest tokens: positions seen_end - fresh .. seen_end - 1
            rows = torch.arange(self.seen_end - fresh, self.seen_end, device=self.device) % f.residual
            self.ring[:, :, :, rows] = full[:, :, :, -fresh:]
            self._key_form()[:, :, end - fresh:end] = full[0, :, :, -fresh:]
            self._kv[1][:, :, end - fresh:end] = full[1, :, :, -fresh:]
        return self.raw_keys

    def _written_by_blocks(self, n: int, end: int, full: torch.Tensor) -> bool:
        """`written` with keys per channel over blocks: values encoded per entry, keys when their block is
        taken (`KeyBlocks.take`, before the ring turns over the tokens it reads)."""
        f, values = self.form, self._kv[1][:, :, n:end]
        held = f.encode(full[1:], self.state)
        for name, side in self.sides.items():
            side[:, :, :, n:end] = held[name]
        values.copy_(f.decode(held, self.dtype, self.state)[0])
        self.blocks.take(self, n, end, full[0], self.ring[0] if self.ring is not None else full[0, :, :, :0])
        if self.ring_len:
            fresh = min(end - n, self.ring_len)
            rows = torch.arange(self.seen_end - fresh, self.seen_end, device=self.device) % self.ring_len
            self.ring[:, :, :, rows] = full[:, :, :, -fresh:]
        if f.residual:
            fresh = min(end - n, f.residual)
            values[:, :, -fresh:] = full[1, :, :, -fresh:]
        return self.raw_keys

    def release(self) -> None:
        """After a forward: only the held form stays (and the cache's working buffer, given back)."""
        self._kv = None
        self._raw = None
        self._give_back()

    def _give_back(self) -> None:
        if self.working is not None:
            self.working.give_back(self)

    def _lent(self) -> bool:
        """Whether `kv` (and `raw`) are the cache's working buffer's now."""
        return self.working is not None and self.working.lent_to(self)

    def _materialize(self, count: int, lend: bool = False) -> None:
        """A working `kv` (and `raw`) with the images of the first `count` slots; those among the
        `residual` most recent tokens at `seen_end` taken back from the ring. `lend`: a forward's, in the
        cache's working buffer when no other layer holds it (an inspection between forwards gets its own)."""
        f = self.form
        shape = (self.batch, self.heads, self.capacity, self.head_dim)
        shapes = [(2, *shape), shape] if self.raw_keys else [(2, *shape)]
        # slots past `count` are written before anything reads them (a forward's new entries), or never read
        lent = self.working.lend(self, shapes, self.dtype, self.device) if lend and self.working else None
        work = lent or [torch.empty(s, dtype=self.dtype, device=self.device) for s in shapes]
        self._kv, self._raw = work[0], work[1] if self.raw_keys else None
        if self.blocks is not None:  # keys by their blocks, values alone by the form
            ring = None if self.ring is None else self.ring[0]
            self._key_form()[:, :, :count] = self.blocks.images(self, count, ring)
            self._decode(self._kv[1:], count)
            pairs = [(1, self._kv[1])]
        else:
            self._decode(self._kv, count)
            if self.raw_keys:  # the held keys are the un-rotated ones: the position mode rotates them into kv
                self._raw[:, :, :count] = self._kv[0, :, :, :count]
            pairs = list(enumerate((self._key_form(), self._kv[1])))
        for i, x in pairs:
            if f.residual and count:
                read_ring(x[:, :, :count], self.pos[:, :, :count], self.ring[i], self.seen_end - f.residual)

    def _decode(self, out: torch.Tensor, count: int) -> None:
        """The held `sides` of slots `0..count-1` decoded into `out` `[sides, B, H, >= count, D]`: one call,
        reading the parts where they are held (no stacked copy of the codes: 8.4 MB per layer and step at
        Llama-3.1-8B's shape, 4,096 entries)."""
        self.form.decode_into({name: side[:, :, :, :count] for name, side in self.sides.items()},
                              out[:, :, :, :count], self.state)

    def held_bytes(self, entries: int, full_bytes: int | None = None) -> int:
        """Bytes this storage holds for `entries` entries (summed over rows and heads): the form's parts
        per entry (codes, scales and zero points), its state (fp8's scales), plus the residual ring.
        `full_bytes`: count the floating-point parts at the model's dtype (scales, zeros, ring) at that
        many bytes per number (2: bf16) instead."""
        f, d = self.form, self.head_dim
        number = full_bytes or torch.empty((), dtype=self.dtype).element_size()
        ring = 2 * self.batch * self.heads * self.ring_len * d * number
        blocks = self.blocks.bytes(number) if self.blocks is not None else 0
        return entries * f.entry_bytes(d, number) + ring + blocks + f.state_bytes(self.state)

    def allocated_bytes(self) -> int:
        """Bytes of every held buffer (all slots, the room after the held ones included), plus a working
        `kv` of its own while it has one (not the cache's working buffer: `EvictingCache.memory` counts that)."""
        held = sum(b.numel() * b.element_size() for b in self.held.values())
        ring = self.ring.numel() * self.ring.element_size() if self.ring is not None else 0
        # a working copy of its own counts here; the cache's working buffer once, by the cache
        work = 0 if self._lent() else sum(b.numel() * b.element_size() for b in (self._kv, self._raw) if b is not None)
        blocks = self.blocks.bytes(self.blocks.scale.element_size()) if self.blocks is not None else 0
        return held + ring + work + blocks + self.form.state_bytes(self.state)


def storage_form_of(
    policies: Sequence, head_dim: int, working: WorkingBuffer | None = None
) -> Callable[..., SlotStorage]:
    """The storage form every layer of a cache running `policies` (one per row) uses: `SlotStorage`, or
    `QuantizedStorage` with the rows' `StorageForm` and the cache's `working` buffer bound. One layer holds
    one form, so rows must agree."""
    forms = {p.kv_storage for p in policies}
    if len(forms) > 1:
        specs = ", ".join(sorted(p.spec() for p in policies))
        raise KvevictError(
            f"rows of one cache must hold their entries alike ({specs}): a layer has one storage form, so run "
            "each storage form (q8+, q4+, q2+, fp8+ and unquantized) in a batch of its own"
        )
    form = forms.pop()
    if form is None:
        return SlotStorage
    form.check_head_dim(head_dim)
    form.require()
    return functools.partial(QuantizedStorage, form=form, working=working)
