"""The engine: a transformers `Cache` that evicts, and the attention function that feeds it.

| module | owns |
|---|---|
| `cache.py` | `EvictingCache`: dispatches to layers; policies, rows, position mode, budgets |
| `layer_interface.py` | `CacheLayer`: what the cache and attention ask of a layer; what all layers share |
| `slot_layer.py` | `SlotLayer`: slot storage, its ring and crop, shared by the uniform and sliding layers |
| `layer.py` | `EvictingLayer`: the uniform layer: one layer's statistics and eviction by its policies |
| `sliding.py` | `SlidingLayer`: a sliding-window layer keeps the model's own window |
| `per_head/` | `RaggedLayer` and its storage and allocation: per-head budgets (Ada-KV) |
| `layer_setup.py` | each kind of layer's class (`LAYER_KINDS`) and every layer's settings |
| `policy_states.py` | what each policy carries from one step of a layer to the next |
| `memory.py` | entries and bytes held, per layer and summed per kind |
| `model_info.py` | what the engine reads off a model's config; `check_model` |
| `layer_settings.py` | `LayerSettings` (one layer's fixed settings), `Forward` (the forward in flight) |
| `storage.py` | slot buffers: in-place writes, gather, hole filling |
| `positions.py` | the two position modes (original, shifted) as strategy objects |
| `statistics.py` | what policies asked for, measured once, handed back |
| `probabilities.py` | the attention-statistics kernel's default bound (`kvevict.attention_stats`); SDPA's call |
| `query_window.py` | the last queries of a layer (SnapKV's observation window) |
| `selection.py` | victim and kept slots from scores |
| `rows.py` | which policy runs in which batch row |
| `rotary.py` | RoPE at any position, from the model's rotary module |
| `observers.py` | metrics attached from outside: largest size, sink loss |
| `inputs.py` | positions the model used; errors for inputs the cache refuses |
| `replay.py` | token-by-token eviction inside a forward of many tokens (chunked evaluation) |
| `attention.py` | the registered attention function and mask hook |

The public names are imported on first use (PEP 562): a submodule such as `model_info` is read
without importing transformers' cache and attention machinery.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import exports
from ..position_modes import POSITION_MODES

# public name -> the submodule that defines it
_EXPORTS = {
    "EvictingCache": ".cache",
    "EvictingLayer": ".layer",
    "Eviction": ".observers",
    "KeptTracker": ".observers",
    "Observer": ".observers",
    "SinkTracker": ".observers",
    "attach": ".attention",
}

if TYPE_CHECKING:
    from .attention import attach
    from .cache import EvictingCache
    from .layer import EvictingLayer
    from .observers import Eviction, KeptTracker, Observer, SinkTracker


__getattr__, __dir__ = exports(__name__, _EXPORTS)
__all__ = [
    "POSITION_MODES",
    "EvictingCache",
    "EvictingLayer",
    "Eviction",
    "KeptTracker",
    "Observer",
    "SinkTracker",
    "attach",
]
