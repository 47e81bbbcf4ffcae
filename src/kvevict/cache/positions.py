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

The layer asks its mode; no other module branches on the mode's name.
"""

from __future__ import annotations

import torch

from .rotary import Rotary
from .storage import SlotStorage


class PositionMode:
    """What both modes share: the model's rotary module, to move vectors between positions."""

    name: str

    def __init__(self, rotary: Rotary) -> None:
        self.rotary = rotary

    def move(self, x: torch.Tensor, used: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """`x` `[..., m, D]` rotated at `used` `[m]`, as it would be rotated at `target` `[m]`."""
        return x if torch.equal(used, target) else self.rotary.move(x, used, target)


class OriginalPositions(PositionMode):
    name = "original"
    #: un-rotated keys are not needed
    raw_keys = False
    #: a decode step may move the newest slot into the victim's place
    fills_holes = True

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

    def align_query(self, query: torch.Tensor, used: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The queries `[B, H_q, q, D]` rotated where the keys expect them, and those positions `[q]`."""
        return query, used

    def now(self, stream: torch.Tensor, seen: int, total: int) -> torch.Tensor:
        """Where tokens at stream positions `stream`, all still cached, sit now."""
        return stream

    def after_compaction(self, storage: SlotStorage, count: int) -> None:
        """Rebuild what a compaction to `count` slots left stale (nothing here)."""


class ShiftedPositions(PositionMode):
    name = "cache"
    raw_keys = True
    fills_holes = False

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

    def align_query(self, query: torch.Tensor, used: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        target = torch.arange(n, n + query.shape[2], device=query.device)
        return self.move(query, used, target), target

    def now(self, stream: torch.Tensor, seen: int, total: int) -> torch.Tensor:
        # Every such token is still cached, so its slot is fixed by how many came after it.
        return total - (seen - stream)

    def after_compaction(self, storage: SlotStorage, count: int) -> None:
        cos, sin = self.rotary.table(count)
        storage.keys[:, :, :count] = self.rotary.rotate(storage.raw[:, :, :count], cos, sin)


MODES: dict[str, type[PositionMode]] = {mode.name: mode for mode in (OriginalPositions, ShiftedPositions)}
POSITION_MODES = tuple(MODES)
