"""`CacheLayer`: what the cache, kvevict's attention function and transformers' `Cache` ask of a layer.

Three peers implement it, each owning its own state (`docs/architecture.md`):

* `uniform.EvictingLayer`: every row and head holds the same number of entries in slots;
  its policies pick what goes (also a sliding-window layer whose engine bounds every layer);
* `sliding.SlidingLayer`: a sliding-window layer keeping the model's own window, no policy;
* `per_head.RaggedLayer`: each KV head holds its own share of the row's allowance (Ada-KV).

The first two share their slot storage, its ring and its crop through `slots.SlotLayer`.
This base holds only what all three do alike: the forward's keys and values arrive
(`update`: the checks, the positions the model used, the hand-off to the attention
function), transformers' layer API, the budget the cache hands over, and the memory a
layer counts from its own storage. What differs is abstract:

* the storage (`_new_storage`, `_store`);
* attention: `replays(q)` says whether the layer computes a forward's attention itself
  (`replay`); otherwise the attention function runs SDPA around `align_query`,
  `window_mask`, `plan` and `finish`, which `SlotLayer` declares;
* eviction held back (`evict_deferred`), `crop`, `batch_select_indices`;
* what it holds (`kept_positions`, `head_lengths`).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import replace

import torch
from transformers.cache_utils import CacheLayerMixin

from ...errors import KvevictError
from ..inputs import attach_error, model_positions
from ..memory import LayerMemory
from ..observers import Eviction
from .settings import Forward, LayerSettings

#: the name kvevict's attention function is registered under in transformers
NAME = "kvevict"
#: where `update` leaves the layer in the model's attention kwargs for the attention function
LAYER_KEY = "kvevict_layer"


class CacheLayer(CacheLayerMixin):
    """One layer of an `EvictingCache`: stores a forward's entries and answers for what it holds."""

    is_compileable = False
    #: the KV heads may hold different numbers of entries (per-head budgets: `per_head.RaggedLayer`)
    heads_differ = False
    #: can hold a forward's eviction back until `evict_deferred` (see `EvictingCache.defer`)
    can_defer = True
    #: the request kinds (`AttentionRequest.kind`) its own forwards measure for its policies; None: it runs none
    measures: frozenset[str] | None = None

    def __init__(self, index: int, settings: LayerSettings) -> None:
        super().__init__()
        self.index = index
        self.settings = settings
        self.window = settings.window  # the model's sliding window on a sliding-window layer, else None
        self.is_sliding = self.window is not None  # transformers' `Cache.is_sliding` reads it too
        self.n = 0  # entries kept (valid slots are 0..n-1; per-head layers: the longest head)
        self.seen = 0  # tokens that have gone through this layer
        self.new = 0  # tokens of the forward in flight
        self.pending = False  # updated, waiting for kvevict's attention to finish
        self.storage = None  # made at the first forward (`_new_storage`)
        # Rows hold the same tokens so far (no eviction, no per-row forward): a one-row
        # forward may stand for all of them.
        self.identical = True
        self._budget: int | None = None
        self.forward = Forward()  # the forward in flight, handed over by the cache at `update`
        # the next eviction is held back: statistics measured, nothing evicted (`EvictingCache.defer`)
        self.deferred = False
        # never evicts again (`EvictingCache.freeze(final=True)`): the policies' statistics are no longer measured
        self.sealed = False
        # slots to grow to at once when the layer must grow (`EvictingCache.reserve`): a chunked prefill's context
        self.reserved = 0

    @property
    def budget(self) -> int | None:
        """Entries this layer keeps between forwards (None: never evict)."""
        return self._budget

    def set_budget(self, budget: int | None) -> None:
        """Called by the cache alone (`EvictingCache.budget`, `freeze`): lowering it evicts at the next forward."""
        self._budget = budget

    # --- what differs ----------------------------------------------------------------
    @abstractmethod
    def _new_storage(self):
        """The layer's buffers, made at its first forward (dimensions set on the layer)."""

    @abstractmethod
    def _store(self, key_states: torch.Tensor, value_states: torch.Tensor, used: torch.Tensor | None):
        """Take the forward's keys and values `[B or 1, H_kv, q, D]` (`used` `[q]` their positions where the
        mode needs them); return what transformers' `update` returns (the keys and values attention reads)."""

    @abstractmethod
    def replays(self, q: int) -> bool:
        """Whether this layer computes the attention of a forward of `q` tokens itself (`replay`)."""

    def replay(self, query: torch.Tensor, kwargs: dict, scaling: float) -> torch.Tensor:
        """Attention and eviction of a forward: query `[B or 1, H_q, q, D]` -> output `[B or 1, H_q, q, D]`.
        Called only where `replays` says so: a layer whose `replays` never does (a sliding-window layer)
        has nothing to implement."""
        raise NotImplementedError(f"{type(self).__name__} never computes a forward's attention itself")

    @abstractmethod
    def evict_deferred(self) -> None:
        """Evict what the forward held back (`EvictingCache.defer`) at the budget this layer has now."""

    @abstractmethod
    def crop(self, tokens_to_remove: int) -> None:
        """Take the `-tokens_to_remove` latest tokens back out (transformers' `crop` with a negative count)."""

    @abstractmethod
    def batch_select_indices(self, index: torch.Tensor) -> None:
        """Keep only the rows `index` `[b]` of a sealed layer (the cache re-numbered its row groups)."""

    @abstractmethod
    def kept_positions(self) -> torch.Tensor:
        """`[B, H_kv, L]` original positions each head holds, ascending (shorter heads padded with -1)."""

    @abstractmethod
    def head_lengths(self) -> torch.Tensor:
        """`[B, H_kv]` entries each (row, KV head) holds."""

    # --- transformers' layer API -------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, heads, _, dim = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.heads, self.head_dim = self.settings.layout.rows_for(key_states.shape[0]), heads, dim
        self.storage = self._new_storage()
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, forward: Forward | None = None, **kwargs
    ):
        """Store the forward's keys and values; `forward` is the cache's record of the forward in flight."""
        self.forward = forward if forward is not None else Forward()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        model_kwargs = kwargs.get("kwargs")
        handoff = None
        if not isinstance(model_kwargs, dict):  # GPT-NeoX: the layer goes through its attention module instead
            handoff = self.settings.handoff
            if handoff is None:
                raise KvevictError(
                    "this model does not hand its attention arguments to the cache (cache.update(..., kwargs=...)) "
                    "and kvevict found no attention module with this layer's index: use a model from the "
                    "architecture matrix (Llama, Mistral, Qwen2/3, Gemma 3, Phi-3, GPT-NeoX, GPT-2, OPT)"
                )
            model_kwargs = {}
        if self.pending or (self.index == 0 and getattr(self.settings.config, "_attn_implementation", None) != NAME):
            self.pending = False
            raise attach_error()
        self._check_rows(key_states.shape[0])
        self._check_finite(key_states, value_states)
        q = key_states.shape[2]
        out = self._store(key_states, value_states, self._used_positions(model_kwargs, q))
        model_kwargs[LAYER_KEY] = self
        if handoff is not None:
            handoff.layer = self
        self.new = q
        self.seen += q
        self.pending = True
        return out

    def _used_positions(self, model_kwargs: dict, q: int) -> torch.Tensor | None:
        """`[q]` positions of the forward's keys, where the layer needs them (layer 0 checks them and puts
        them on the forward's record), else None."""
        mode = self.settings.mode
        if not (self.index == 0 or mode.keys_need_positions(self.index)):
            return None
        # Positions are the same for every layer of a forward: check them once, at layer 0.
        start = mode.seq_length(self.n, self.seen)
        used = self._positions(model_kwargs, q, start, check_rows=self.index == 0)
        if self.index == 0:
            self.forward = replace(self.forward, positions=used)
        if self.index == 0 and self.seen and not mode.continues(int(used[0]), self.n, self.seen):
            raise KvevictError(
                f"this cache already holds {self.seen} tokens of a sequence, but the new tokens start at position "
                f"{int(used[0])}: call cache.reset() (or make a new EvictingCache) before reusing it for another "
                "sequence"
            )
        return used

    def _check_rows(self, rows: int) -> None:
        if rows == 1 and self.batch_size > 1 and not self.identical:
            raise KvevictError(
                f"this cache holds {self.batch_size} rows (one per policy) and they diverged at the first eviction: "
                f"a one-row forward can only stand for all rows before that; feed {self.batch_size} rows "
                f"(input_ids.expand({self.batch_size}, -1))"
            )
        if rows not in (1, self.batch_size):
            raise KvevictError(
                f"this cache holds {self.batch_size} sequences but got a batch of {rows}: "
                "use a new EvictingCache for each batch (cache.reset() to reuse it)"
            )
        if rows == self.batch_size and rows > 1:
            self.identical = False

    def _check_finite(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # NaN/inf reaching any layer reaches the last one: checking the first (bad inputs)
        # and the last (bad weights anywhere) catches both without a sync per layer.
        if self.index in (0, self.settings.last_layer) and not bool(
            torch.isfinite(key_states).all() and torch.isfinite(value_states).all()
        ):
            raise KvevictError(
                f"layer {self.index} produced NaN/inf keys or values: check the inputs (inputs_embeds) and the "
                "model weights; the cache refuses to rank entries by NaN scores"
            )

    def get_seq_length(self) -> int:
        return self.settings.mode.seq_length(self.n, self.seen)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.n + query_length, 0

    def get_max_length(self) -> int:
        return -1 if self.budget is None else self.budget

    def reset(self) -> None:
        """Forget the sequence (transformers' `Cache.reset`); each layer also clears what it owns."""
        self.n = self.seen = self.new = 0
        self.sealed = False
        self.identical = True
        self.pending = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise KvevictError("EvictingCache does not support beam search: use greedy or sampling (num_beams=1)")

    # --- positions ---------------------------------------------------------------------
    def _query_positions(self, query: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """`[q]` positions the model rotated this forward's queries at."""
        start = self.settings.mode.seq_length(self.n, self.seen - self.new)
        return self._positions(kwargs, query.shape[2], start, check_rows=False)

    def _positions(self, kwargs: dict, q: int, start: int, check_rows: bool) -> torch.Tensor:
        """`[q]` positions the model used: its `position_ids`, or else layer 0's (every layer of
        a forward shares them; a layer's own count can differ from layer 0's in position-shift mode)."""
        shared = self.forward.positions
        if "position_ids" not in kwargs and self.index and shared is not None and shared.numel() == q:
            return shared
        return model_positions(kwargs, q, start, self.device, check_rows=check_rows)

    # --- observers, crop, memory ---------------------------------------------------------
    @property
    def wants_victims(self) -> bool:
        """Whether an observer wants an eviction's victims (their positions cost a gather to find)."""
        return any(observer.wants_victims for observer in self.settings.observers)

    def report_eviction(self, seen: int, kept: torch.Tensor | None, victims: torch.Tensor | None) -> None:
        """Tell the observers what this layer evicted when it had seen `seen` tokens (see `Eviction`)."""
        observers = self.settings.observers
        if observers:
            event = Eviction(self.index, seen, kept, victims)
            for observer in observers:
                observer.on_evict(event)

    def _check_holds_latest(self, latest: torch.Tensor, count: int) -> None:
        """`crop`'s condition: `latest` `[B, H_kv, slots]` marks the latest tokens held, `count` per
        row and head."""
        if not bool((latest.sum(dim=-1) == count).all()):
            raise KvevictError(f"layer {self.index} does not hold all of the {count} latest tokens in every row "
                               "and head, so they cannot be taken back out: pin them while compressing")

    def full_length(self) -> int:
        """Entries a full cache holds here for the tokens seen: all of them, or on a sliding-window layer the
        model's window less one (what transformers' sliding layers keep, and what a full cache would hold)."""
        return min(self.seen, self.window - 1) if self.is_sliding else self.seen

    def memory(self) -> LayerMemory | None:
        """This layer's entries and KV bytes (None before its first forward); its storage's business alone."""
        if not self.is_initialized:
            return None
        storage = self.storage  # it counts what it holds: codes and scales for a quantized form
        entry = 2 * self.head_dim * torch.empty((), dtype=self.dtype).element_size()  # one key and its value
        lengths = self.head_lengths()  # [B, H_kv]
        held = int(lengths.sum())
        return LayerMemory(
            per_head=lengths.tolist(),
            kv_bytes=storage.held_bytes(held),
            full_kv_bytes=entry * self.batch_size * self.heads * self.full_length(),
            allocated_kv_bytes=storage.allocated_bytes(),
            heads_differ=self.heads_differ,
            kv_bytes_bf16=storage.held_bytes(held, full_bytes=2),
        )
