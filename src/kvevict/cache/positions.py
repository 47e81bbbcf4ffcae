"""Position modes: what position a kept key and a new query carry. Two strategies, one interface.

* `OriginalPositions` (`"original"`): each key keeps the RoPE rotation of its position
  in the stream, as H2O, SnapKV and kvpress do. Nothing is ever re-rotated; a decode
  step may fill the victim's slot in place (slots then leave positional order, which
  attention does not care about: every kept entry is older than every new token).
* `ShiftedPositions` (`"cache"`): StreamingLLM's position shift. Kept entries are
  numbered `0..L-1` in order and a new token sits at `L`, so the model never sees a
  position beyond its budget. Keys are stored un-rotated as well and rotated from
  scratch to their slot after every eviction, so no error accumulates; eviction
  therefore always compacts (every later slot moves down one position).

The layers and the chunk replay ask their mode (`new_storage`, `store_keys`,
`align_query`, `evict`, `compact`, `by_keys`); nothing outside this module tests which
mode it holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from . import selection
from .rotary import Rotary
from .storage import SlotStorage

T = TypeVar("T")


class PositionMode:
    """What both modes share: the model's rotary module, to move vectors between positions,
    and eviction by compaction."""

    name: str
    #: the storage keeps un-rotated copies of the keys (to rotate them again after an eviction)
    raw_keys: bool
    #: a decode step's victim slot may be refilled in place by the newest entry (nothing is renumbered)
    fills_in_place: bool

    def __init__(self, rotary: Rotary) -> None:
        self.rotary = rotary

    def new_storage(
        self, batch: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
        stat_names: tuple[str, ...], capacity: int, form: Callable[..., SlotStorage] = SlotStorage,
    ) -> SlotStorage:
        """Slot buffers for one layer, with the un-rotated key copies this mode needs, of the storage
        form `form` (`SlotStorage`, or a quantized one: `LayerSettings.storage_form`)."""
        return form(batch, heads, head_dim, dtype, device, stat_names, self.raw_keys, capacity)

    def by_keys(self, fixed: T, renumbered: T) -> T:
        """Of two ways to do one thing, this mode's: `fixed` where a stored key keeps its rotation
        for good (original positions), `renumbered` where kept keys are renumbered at every
        eviction (position shift). The chunk replay picks its algorithms with it."""
        raise NotImplementedError

    def compact(self, storage: SlotStorage, keep: torch.Tensor, count: int) -> None:
        """Move the slots `keep` `[B, H, count]` to the front, in order, and rebuild what moving left stale."""
        storage.gather(keep, keys=not self.raw_keys)
        self.after_compaction(storage, count)

    def after_compaction(self, storage: SlotStorage, count: int) -> None:
        """Rebuild what a compaction to `count` slots left stale."""
        raise NotImplementedError

    def evict(
        self, storage: SlotStorage, scores: torch.Tensor, total: int, budget: int, ordered: bool, victims: bool
    ) -> tuple[torch.Tensor | None, bool]:
        """Keep the `budget` best-scoring of the `total` slots (scores `[B, H, total]`).

        Returns the evicted positions `[B, H]` when one entry left in place and `victims`
        was asked for (else None), and whether the slots are in positional order after.
        This base form compacts: the kept slots move to the front in positional order.
        """
        keep = selection.keep_slots(scores, storage.pos[:, :, :total], budget, ordered)
        self.compact(storage, keep, budget)
        return None, True

    def align_query(
        self, query: torch.Tensor, used: Callable[[], torch.Tensor], n: int, remember: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The queries `[B, H_q, q, D]` rotated where the keys expect them, and those positions `[q]`
        (None when nothing needs them). `used()` gives the positions the model rotated them at;
        `remember`: a policy keeps recent queries, so their positions are needed."""
        raise NotImplementedError

    def move(self, x: torch.Tensor, used: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """`x` `[..., m, D]` rotated at `used` `[m]`, as it would be rotated at `target` `[m]`."""
        return x if torch.equal(used, target) else self.rotary.move(x, used, target)


class OriginalPositions(PositionMode):
    name = "original"
    raw_keys = False
    fills_in_place = True

    def seq_length(self, n: int, seen: int) -> int:
        """What the cache reports to transformers: where the next token's position starts."""
        return seen

    def continues(self, first: int, n: int, seen: int) -> bool:
        """Whether a forward whose first token sits at `first` continues this sequence."""
        return first == seen

    def keys_need_positions(self, layer: int) -> bool:
        """Whether `store_keys` needs the positions the model used (else: only layer 0 checks them)."""
        return False

    def store_keys(self, storage: SlotStorage, keys: torch.Tensor, used: torch.Tensor | None, n: int) -> None:
        storage.keys[:, :, n : n + keys.shape[2]] = keys

    def align_query(self, query, used, n, remember):
        return query, used() if remember else None  # keys sit where the model rotated the queries

    def by_keys(self, fixed: T, renumbered: T) -> T:
        return fixed

    def evict(self, storage, scores, total, budget, ordered, victims):
        if total != budget + 1:
            return super().evict(storage, scores, total, budget, ordered, victims)
        # one over the budget (a decode step): the newest slot moves into the victim's place
        pos = storage.pos[:, :, :total]
        victim = selection.victim(scores, pos, ordered)
        evicted = pos.gather(-1, victim[..., None])[..., 0] if victims else None
        storage.fill_hole(victim, budget)
        return evicted, False

    def now(self, stream: torch.Tensor, seen: int, total: int) -> torch.Tensor:
        """Where tokens at stream positions `stream`, all still cached, sit now."""
        return stream

    def after_compaction(self, storage: SlotStorage, count: int) -> None:
        """Nothing to rebuild: a key keeps its rotation wherever its slot moves."""


class ShiftedPositions(PositionMode):
    name = "cache"
    raw_keys = True
    fills_in_place = False

    def seq_length(self, n: int, seen: int) -> int:
        return n

    def continues(self, first: int, n: int, seen: int) -> bool:
        return first in (n, seen)

    def keys_need_positions(self, layer: int) -> bool:
        return True

    def store_keys(self, storage: SlotStorage, keys: torch.Tensor, used: torch.Tensor | None, n: int) -> None:
        end = n + keys.shape[2]
        raw = self.rotary.unrotate(keys, *self.rotary.at(used))
        storage.raw[:, :, n:end] = raw
        cos, sin = self.rotary.table(end)
        storage.keys[:, :, n:end] = self.rotary.rotate(raw, cos[n:], sin[n:])

    def align_query(self, query, used, n, remember):
        target = torch.arange(n, n + query.shape[2], device=query.device)
        return self.move(query, used(), target), target

    def by_keys(self, fixed: T, renumbered: T) -> T:
        return renumbered

    def now(self, stream: torch.Tensor, seen: int, total: int) -> torch.Tensor:
        # Every such token is still cached, so its slot is fixed by how many came after it.
        return total - (seen - stream)

    def after_compaction(self, storage: SlotStorage, count: int) -> None:
        cos, sin = self.rotary.table(count)
        storage.keys[:, :, :count] = self.rotary.rotate(storage.raw[:, :, :count], cos, sin)


MODES: dict[str, type[PositionMode]] = {mode.name: mode for mode in (OriginalPositions, ShiftedPositions)}
POSITION_MODES = tuple(MODES)
