"""What a layer is told: `LayerSettings` once, at construction; a `Forward` at every forward.

Nothing here is written by one layer for another to read behind the cache's back:

* `LayerSettings` is frozen. The cache builds one per layer (its position mode, its
  sliding window, its hand-off slot) and the layer only reads it. A budget is not a
  setting: the cache hands each layer its number through `CacheLayer.set_budget`.
* `Forward` is a read-only record of one forward of the model through the cache. The
  cache starts an empty one at layer 0 and hands each later layer the record the layer
  before it ended with (`CacheLayer.forward`). A layer that adds something for the
  next (layer 0: the positions the model used; a closed-form replay plan) makes a new
  record with it (`dataclasses.replace`) and ends with that one; no record is changed
  after it is made, and each lives exactly as long as its forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...attention_stats import Workspace
from ..observers import Observer
from ..rows import RowLayout
from ..storage.slots import SlotStorage

if TYPE_CHECKING:
    from ..positions.modes import PositionMode


@dataclass(frozen=True)
class LayerSettings:
    """One layer's fixed settings, set by the cache at construction and never changed."""

    mode: PositionMode  # the position mode, with this layer kind's rotary module
    layout: RowLayout  # which policy runs in which row: one object for all layers, bound at the first forward
    stat_names: tuple[str, ...]  # per-slot statistics the policies carry
    query_window: int  # recent queries to remember (SnapKV)
    slack: int  # room after the budget a forward's new tokens are written into
    last_layer: int
    per_token: bool  # a forward of many tokens evicts as that many one-token forwards would
    config: object  # the model's config: its attention implementation must be kvevict's
    observers: tuple[Observer, ...] = ()
    # where `update` leaves the layer for models that hand the cache no attention kwargs (GPT-NeoX):
    # a thread-local slot on this layer's attention module (see attention.handoffs), or None
    handoff: object | None = None
    window: int | None = None  # a sliding-window layer's window (`config.sliding_window`)
    # every row's policy evicts the oldest entry after its first `fifo_after` tokens (`Policy.fifo_after`),
    # so a decode step's victim slot is known without scores; None otherwise
    fifo_after: int | None = None
    # builds the layer's slot storage: `SlotStorage` (entries at the model's dtype) or another storage form
    # with its settings bound (`quantized.QuantizedStorage`, chosen by the cache from `Policy.kv_storage`)
    storage_form: Callable[..., SlotStorage] = SlotStorage
    # the bound on the attention logits one block of queries holds while statistics are measured
    # (`attention_stats.Workspace`, `EvictingCache(..., workspace=...)`); None: the default,
    # `probabilities.BLOCK_ELEMENTS` float32 logits (64 MiB), read where it is used (`probabilities.bound`)
    workspace: Workspace | None = None


@dataclass(frozen=True, eq=False)
class Forward:
    """A read-only record of the forward in flight, started by the cache at layer 0 and handed on.

    `positions` `[q]`: the positions layer 0 found (from `position_ids` or its own
    count), the answer for later layers when the model hands them no `position_ids`
    (Gemma 3 before transformers 5.24, GPT-NeoX). `static_plan`: the closed-form replay
    plan of this forward's chunk (`chunk.StaticPlan`), which the next layer reuses when
    it ranks the same tokens the same way (checked by equality, never assumed).
    """

    positions: torch.Tensor | None = None
    static_plan: object | None = None
    #: a repeat forward of KVzip's reconstruction (`EvictingCache.reconstructing`): the context chunk
    #: `(start, end)` it repeats, whose entries a `"reconstruction"` request scores; None otherwise
    reconstruct: tuple[int, int] | None = None
