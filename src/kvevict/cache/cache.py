"""`EvictingCache`: a transformers `Cache` that keeps at most a budget of entries per layer
and KV head, choosing survivors with a pluggable policy per batch row.

Like transformers' own caches it only dispatches: `update` goes to the layer (one of the peers behind
`interface.CacheLayer`, chosen per kind in `layers/setup.py`), which stores, evicts and reports what it
evicted to the observers an evaluation attached (`observers.py`). The cache holds what all layers share:
the policies and their rows, the position mode, the per-layer budgets, the storage forms' working buffer.

Rows of a batch hold the same tokens until the first eviction, so a one-row forward may
stand for all of them (`shares_rows`): an A/B batch computes its shared prefill once.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache

from ..attention_stats import Workspace
from ..errors import KvevictError
from ..policies import Policy, check_policy
from ..position_modes import DEFAULT_POSITIONS, check_positions
from .attention import attach
from .layers.per_head.reconstruction import layer_totals
from .layers.settings import Forward
from .layers.setup import check_measures, layer_classes, layer_settings, position_modes
from .memory import CacheMemory, summed
from .model_info import check_model, layer_kinds, text_config
from .observers import KeptTracker, Observer, SinkTracker, held_pinned_lost, held_sink_loss
from .reconstructing import Reconstructing
from .rows import RowLayout
from .storage.working import WorkingBuffer


class EvictingCache(Reconstructing, Cache):
    """A bounded KV cache; each batch row may run its own policy at the same budget.

    `policy` is a spec string, a `Policy`, or a sequence of them (one per batch row). `observers` are told what each
    layer holds and evicts; by default a `KeptTracker` and a `SinkTracker` (behind `max_kept()` and
    `sink_lost_at()`); pass `[]` for none. `per_token=True` makes a forward of many tokens evict exactly as that many
    one-token forwards would (chunked streaming evaluation, `replay/chunk.py`); by default a forward attends to
    everything it holds and evicts once at its end (prompt compression). `workspace` bounds the attention logits the
    statistics hold at once: bytes of float32 logits per block of queries (`attention_stats.Workspace`, or one with
    an observer told each block's bytes); None: 64 MiB (`probabilities.BLOCK_ELEMENTS` logits). A long prefill's
    statistics are measured a block of queries at a time within it, so their memory never grows with the context.
    Constructing the cache attaches kvevict's attention function to `model`.
    """

    def __init__(
        self,
        model,
        policy: str | Policy | Sequence[str | Policy] = "streamingllm",
        budget: int | None = 256,
        positions: str = DEFAULT_POSITIONS,
        slack: int = 16,
        observers: Sequence[Observer] | None = None,
        per_token: bool = False,
        workspace: int | Workspace | None = None,
    ) -> None:
        config = check_model(model)
        workspace = _check_workspace(workspace)
        mode_name = check_positions(positions)
        specs = list(policy) if isinstance(policy, (list, tuple)) else [policy]
        if not specs:
            raise KvevictError("no policy given: pass a spec such as 'streamingllm' or a list, one per row")
        self.policies = [check_policy(spec, None, positions) for spec in specs]
        bounded = [not p.unbounded for p in self.policies]
        if budget is not None and any(bounded) and not all(bounded):
            raise KvevictError(
                "'full' cannot share a batch with bounded policies (its cache grows while theirs do not): "
                "run the full cache in its own batch"
            )
        text = text_config(config)
        layers = text.num_hidden_layers
        kinds = layer_kinds(text)
        modes = position_modes(model, text, kinds, mode_name)
        if observers is None:
            observers = [KeptTracker(), SinkTracker()]
        self.observers = list(observers)
        self.positions = positions
        self.layout = RowLayout(self.policies)
        budget = budget if any(bounded) else None
        self._check_budget(budget, layers)  # before the model is touched
        classes = layer_classes(self.policies)
        check_measures(self.policies, [classes[kind] for kind in set(kinds)], per_token)
        self._working = WorkingBuffer()  # what a storage form's layers decode into, one layer at a time
        settings = layer_settings(model, text, kinds, modes, self.layout, self.observers, slack, per_token,
                                  workspace, self._working)
        attach(model)
        self.kinds = kinds
        super().__init__(layers=[classes[kind](i, settings[i]) for i, kind in enumerate(kinds)])
        self._budgets: list[int | None] = [None] * layers
        self.budget = budget
        self._repeating: tuple[int, int] | None = None  # the chunk a KVzip repeat forward reconstructs
        self.reconstructed = False  # a reconstruction pass scored the held-back context (`reconstructing`)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Dispatch to layer `layer_idx`, with the record of the forward in flight: a new `Forward` at
        layer 0, else the record the layer before ended with (`CacheLayer.forward`)."""
        if layer_idx == 0 and self.layout.bind(self.layout.rows_for(key_states.shape[0])):
            pinned = [p.pinned for p in self.layout.row_policies()]  # the first forward binds rows, once
            for observer in self.observers:
                observer.on_bind(pinned)
        forward = Forward(reconstruct=self._repeating) if layer_idx == 0 else self.layers[layer_idx - 1].forward
        return self.layers[layer_idx].update(key_states, value_states, *args, forward=forward, **kwargs)

    # --- budgets ------------------------------------------------------------------------
    @property
    def budget(self) -> int | None:
        return self._budget

    @budget.setter
    def budget(self, value: int | None) -> None:
        """Change the budget mid-run (lm-eval's generation restores it after compressing): lowering it evicts
        at the next forward; it is validated like a new cache, and each layer is handed its number."""
        if value is not None and self.sealed:
            raise KvevictError(
                "this cache was frozen for good (freeze(final=True)) and measured nothing since: it cannot evict "
                "again; build a new EvictingCache, or freeze() without final to set a budget later"
            )
        self._profile = self._check_budget(value, len(self.layers))
        self._budget = value
        self._set_budgets([self.layer_budget(i, value) for i in range(len(self.layers))])

    def _check_budget(self, value: int | None, layers: int) -> list[int] | None:
        """Validate `value` for every row's policy; the per-layer profile all rows share (None: uniform)."""
        for p in self.policies:
            check_policy(p, value, self.positions)
        profiles = {p.spec(): p.layer_budgets(value, layers) if value is not None else None for p in self.policies}
        if len({None if b is None else tuple(b) for b in profiles.values()}) > 1:
            raise KvevictError(
                f"policies with different per-layer budgets cannot share a batch ({', '.join(profiles)}): "
                "a layer stores one budget for all rows; run each per-layer policy (pyramidkv) in its own batch"
            )
        own = sorted({p.spec() for p in self.policies if p.own_schedule})
        if own and len({p.spec() for p in self.policies}) > 1:
            others = sorted({p.spec() for p in self.policies} - {own[0]})
            raise KvevictError(
                f"'{own[0]}' evicts on its own schedule and cannot share a batch with {', '.join(others)}: every row "
                "of a layer holds the same number of entries; run it in a batch of its own"
            )
        return next(iter(profiles.values()))

    def _set_budgets(self, budgets: list[int | None]) -> None:
        """Hand each layer its budget (the one place layers' budgets change)."""
        self._budgets = list(budgets)
        for layer, budget in zip(self.layers, budgets):
            layer.set_budget(budget)

    def layer_budget(self, layer: int, budget: int | None) -> int | None:
        """Entries layer `layer` keeps when the cache's budget is `budget` (None: never evict).

        The seam for per-layer budgets: every layer keeps `budget` unless the policies
        declare a profile (`Policy.layer_budgets`, PyramidKV), which all rows share.
        """
        if budget is None or self._profile is None:
            return budget
        return self._profile[layer]

    def layer_budgets(self) -> list[int | None]:
        """The budget of each layer (what the report shows for per-layer policies)."""
        return list(self._budgets)

    def freeze(self, final: bool = False) -> None:
        """Stop evicting: later tokens are all kept (context-compression protocol).

        `final`: the cache will never evict again, so the policies' statistics stop being
        measured (a decode step is attention alone) and finished rows may leave the batch
        (`batch_select_indices`); setting a budget afterwards is refused. Without it a budget may be set
        again (lm-eval's generation compresses, then evicts as it generates).
        """
        self._budget = None
        self._set_budgets([None] * len(self.layers))
        if final:
            for layer in self.layers:
                layer.sealed = True

    @property
    def sealed(self) -> bool:
        """Whether the cache was frozen for good (`freeze(final=True)`)."""
        return bool(self.layers) and all(layer.sealed for layer in self.layers)

    def batch_select_indices(self, indices: torch.Tensor | Sequence[int]) -> None:
        """Keep only the batch rows `indices` (in that order; row `indices[i]` is row `i` from now on),
        as transformers' `Cache.batch_select_indices`.

        Why: a batch of answers decodes as long as its longest one; rows that are done can
        leave, so the others' steps cost what their own rows cost. Only a cache frozen for
        good (`freeze(final=True)`): it measures no statistics and evicts nothing, so what
        its layers hold is all that has to follow the rows. Observers are told
        (`Observer.keep_rows`).
        """
        if not self.sealed:
            raise KvevictError(
                "rows can leave only a cache frozen for good (cache.freeze(final=True)): one that may still evict "
                "would need its statistics to follow them"
            )
        rows = [int(r) for r in indices]
        batch = self.layers[0].batch_size if self.layers[0].is_initialized else 0
        if not rows or len(set(rows)) != len(rows) or not all(0 <= r < batch for r in rows):
            raise KvevictError(f"batch_select_indices takes distinct rows of the {batch} this cache holds, got {rows}")
        self.layout.keep_rows(rows)
        self.policies = self.layout.policies
        index = torch.tensor(rows, dtype=torch.long, device=self.layers[0].device)
        for layer in self.layers:
            layer.batch_select_indices(index)
        for observer in self.observers:
            observer.keep_rows(rows)

    @property
    def can_defer(self) -> bool:
        """Whether `defer` may hold an eviction back: every layer can, and the cache does not replay
        token-by-token eviction inside a forward (a stream evicts as it reads)."""
        return all(layer.can_defer and not layer.settings.per_token for layer in self.layers)

    def defer(self) -> None:
        """The next forward measures every statistic as if it evicted, and evicts nothing.

        Why: a context read in one forward is compressed the same way at any budget (each
        query sees the whole context; the budget only decides what is kept afterwards).
        Read it once, copy the state, and `evict_deferred` each copy at its own budget:
        one prefill serves every budget of a RULER grid.
        """
        if not self.can_defer:
            raise KvevictError(
                "this cache cannot hold an eviction back (a token-by-token cache evicts inside the "
                "forward): compress each budget in a prefill of its own"
            )
        for layer in self.layers:
            layer.deferred = True

    def reserve(self, tokens: int) -> None:
        """Grow an unbounded layer at once to hold `tokens` more (0: by a quarter): a chunked prefill allocates once."""
        for layer in self.layers:  # a layer bounded now (a sliding window's) never holds them
            layer.reserved = layer.n + tokens if tokens and layer.budget is None else 0

    @property
    def deferred(self) -> bool:
        """Whether an eviction is held back (`defer`), waiting for `evict_deferred`."""
        return any(layer.deferred for layer in self.layers)

    def evict_deferred(self) -> None:
        """Evict what the forward held back by `defer`, at the budget the cache has now.

        Where a row's policy ranks every layer's entries together (`Policy.ranks_layers`: KVzip), the
        row keeps `layers x KV heads x budget` entries of the per-head layers, each layer as many as it
        holds of the row's best (`reconstruction.layer_totals`); other rows keep `KV heads x budget`.
        """
        totals = self._layer_totals()
        for i, layer in enumerate(self.layers):
            if totals is None or totals[i] is None:
                layer.evict_deferred()
            else:
                layer.evict_deferred(totals[i])

    def _layer_totals(self) -> list[torch.Tensor | None] | None:
        """Per layer `[B]` the entries each row keeps at a held-back eviction, or None: the budget decides."""
        rows = self.layout.row_policies()  # empty before the first forward
        if self._budget is None or not any(p.reconstructs for p in rows):
            return None
        if not self.reconstructed:
            raise KvevictError(
                f"'{rows[0].spec()}' has no scores yet: its context must be reconstructed before it is compressed "
                "(kvevict.compress(model, ids, 'kvzip', budget, tokenizer=tokenizer) runs the repeat forwards)"
            )
        if not any(p.ranks_layers for p in rows):
            return None
        ragged = [i for i, layer in enumerate(self.layers) if layer.heads_differ]
        heads = self.layers[ragged[0]].heads
        joint = layer_totals([self.layers[i].ranked() for i in ragged], len(ragged) * heads * self._budget)
        own = torch.tensor([heads * self._budget if not p.ranks_layers else -1 for p in rows])
        totals: list[torch.Tensor | None] = [None] * len(self.layers)
        for i, counts in zip(ragged, joint):
            totals[i] = torch.where(own.to(counts.device) >= 0, own.to(counts.device), counts)
        return totals

    # --- rows and policies ---------------------------------------------------------------
    @property
    def shares_rows(self) -> bool:
        """Whether every row still holds the same tokens, so one row may stand for all."""
        return all(layer.identical for layer in self.layers)

    def row_policies(self) -> list[Policy]:
        """The policy of each batch row (after the first forward)."""
        return self.layout.row_policies()

    def reset(self) -> None:
        super().reset()
        for observer in self.observers:
            observer.reset()

    def crop(self, tokens_to_remove: int) -> None:
        """Take the `-tokens_to_remove` latest tokens back out of every layer (`CacheLayer.crop`), as
        transformers' `Cache.crop` with a negative count: a question read after a frozen prefix, so the
        next request reads the prefix alone."""
        if tokens_to_remove > 0:
            raise KvevictError(
                f"crop takes the negative number of latest tokens to remove (crop(-{tokens_to_remove})), as "
                f"transformers' Cache.crop does, got {tokens_to_remove}"
            )
        with torch.inference_mode():
            for layer in self.layers:
                layer.crop(tokens_to_remove)

    def held_entries(self) -> int:
        """The most entries any layer holds now (each row and head counted; per-head layers: their longest)."""
        return max(layer.n for layer in self.layers)

    def sliding_windows(self) -> list[int | None]:
        """Per layer, the model's sliding window where the layer is a sliding-window one (it keeps the
        model's own window, whatever the budget), else None."""
        return [layer.window if layer.is_sliding else None for layer in self.layers]

    def copy(self) -> EvictingCache:
        """An independent copy: every tensor and record the cache holds is copied; what is the model's
        (its config, its rotary modules, the hand-off slots on its attention modules) is shared."""
        return copy.deepcopy(self, self._model_memo())

    def _model_memo(self) -> dict[int, object]:
        """A `deepcopy` memo that shares what is the model's: its config, rotary modules and hand-off slots."""
        memo: dict[int, object] = {}
        for layer in self.layers:
            settings = layer.settings
            rotary = settings.mode.rotary
            for shared in (settings.config, settings.handoff, None if rotary is None else rotary.module):
                if shared is not None:
                    memo[id(shared)] = shared
        return memo

    # --- what the cache holds --------------------------------------------------------------
    @property
    def chunk_exact(self) -> bool:
        """Whether a forward of many tokens reads what that many one-token forwards read: not where a row's
        storage form counts its residual or key blocks at a forward's end (`StorageForm.chunk_exact`), and
        a stream must then be fed one token per forward to be scored as decode steps."""
        return all(p.kv_storage is None or p.kv_storage.chunk_exact for p in self.policies)

    def fits(self, q: int) -> bool:
        """Whether a forward of `q` more tokens evicts in no layer the policy runs in (rows stay identical)."""
        return all(layer.budget is None or layer.n + q <= layer.budget for layer in self.layers if not layer.is_sliding)

    @property
    def tokens_seen(self) -> int:
        return self.layers[0].seen if self.layers else 0

    def kept_positions(self) -> list[torch.Tensor]:
        """Per layer the policy runs in, `[B, H_kv, n]` original positions of the entries held, ascending.

        Sliding-window layers (which keep the model's own window) are left out: sink
        loss and pinned sinks are about the layers the budget bounds.
        """
        return [layer.kept_positions() for layer in self.layers if layer.is_initialized and not layer.is_sliding]

    def memory(self) -> CacheMemory:
        """Entries held per kind of layer and the KV bytes, against a full cache of the tokens seen."""
        return summed(self.kinds, self.layers, self._working.bytes())

    def _observer(self, kind: type) -> Observer:
        found = next((o for o in self.observers if isinstance(o, kind)), None)
        if found is None:
            raise KvevictError(f"this cache was built without a {kind.__name__} observer: pass observers=None")
        return found

    def max_kept(self) -> int:
        """The most entries any layer held after a forward (from the `KeptTracker`)."""
        return self._observer(KeptTracker).most

    def sink_lost_at(self) -> torch.Tensor:
        """`[layers, B, H_kv]`: tokens seen when token 0 was evicted, -1 if it never was (`SinkTracker`)."""
        return self._observer(SinkTracker).lost_at(len(self.layers), self.layers[0].heads)

    def sink_loss(self) -> torch.Tensor:
        """Per row: the fraction of (layer, KV head) pairs whose cache no longer holds token 0."""
        return held_sink_loss(self.kept_positions())

    def pinned_sink_evicted(self, row: int | None = None) -> bool:
        """Whether a pinned sink was ever evicted (for `row`, or any row). True would be a bug."""
        wrong = held_pinned_lost(self.kept_positions(), [p.pinned for p in self.row_policies()])
        return bool(wrong.any() if row is None else wrong[row])


def _check_workspace(workspace: int | Workspace | None) -> Workspace | None:
    """The cache's bound on the attention logits a block of queries holds (`EvictingCache`'s `workspace`):
    bytes as given, a `Workspace` as it is, None for the default; anything else refused in one line."""
    if workspace is None:
        return None
    if isinstance(workspace, bool) or not isinstance(workspace, (int, Workspace)):
        raise KvevictError(
            f"workspace={workspace!r} is not a size: pass bytes of attention logits per block (an int such as "
            f"64 << 20), a kvevict.attention_stats.Workspace, or None for the default 64 MiB"
        )
    size = workspace if isinstance(workspace, int) else workspace.bytes
    if size < 1:
        raise KvevictError(
            f"workspace={size} bytes bounds nothing: pass a positive number of bytes (the default is 64 MiB, "
            "64 << 20; a block is never less than one query, whatever the bound)"
        )
    return Workspace(workspace) if isinstance(workspace, int) else workspace
