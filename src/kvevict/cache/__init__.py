"""The engine: a transformers `Cache` that evicts, and the attention function that feeds it.

The folders follow a forward through the engine (`docs/architecture.md` draws it):

| where | holds |
|---|---|
| `cache.py` | `EvictingCache`: dispatches to layers; policies, rows, position mode, budgets |
| `attention.py` | the registered attention function and mask hook: hands a layer's call to the layer |
| `inputs.py` | positions the model used; errors for inputs the cache refuses |
| `layers/` | the three peers behind `CacheLayer` (uniform, sliding, per-head), their settings and setup |
| `storage/` | how a layer holds its entries: slot buffers, codes of a storage form, KIVI's key blocks |
| `positions/` | the two position modes (original, shifted) and RoPE at any position |
| `statistics/` | what policies asked for, measured once (through `kvevict.attention_stats`), handed back |
| `step/` | one eviction step: its stages, its fast paths, views, selection, the policies' states |
| `replay/` | a chunk that evicts token by token, replayed exactly: the reference and its fast paths |
| `rows.py` | which policy runs in which batch row |
| `memory.py` | entries and bytes held, per layer and summed per kind |
| `observers.py` | metrics attached from outside: largest size, sink loss |
| `reconstructing.py` | the part of the cache a policy scored by reconstruction (KVzip) needs |
| `model_info.py` | what the engine reads off a model's config; `check_model` |

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
    "EvictingLayer": ".layers.uniform",
    "Eviction": ".observers",
    "KeptTracker": ".observers",
    "Observer": ".observers",
    "SinkTracker": ".observers",
    "attach": ".attention",
}

if TYPE_CHECKING:
    from .attention import attach
    from .cache import EvictingCache
    from .layers.uniform import EvictingLayer
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
