"""The contract between the cache and an eviction policy.

A policy never touches transformers or the cache buffers. The cache hands it a
`SlotView` of one layer (the rows of the batch that run this policy) and asks for a
score per cached slot; the cache keeps the `budget` highest-scoring slots and does the
gather. Keeping policies as pure functions of small tensors is what lets one batch
run a different policy in each row, and lets tests check a policy against a formula.

**The score convention.** `Policy.scores` returns `[b, H_kv, n]` floats, one per slot
(any floating dtype; the cache compares them as they are). Higher means keep. `+inf`
marks a slot that must stay (a pinned sink, a protected recent window); a policy never
marks more slots `+inf` than its budget, so the order among them never matters. Among
equal scores the cache keeps the later token: policies do not break ties themselves.

**What a policy declares.** Everything the cache, the evaluation or the report needs to
know about a policy is declared on `Policy`, never read off its name: the attributes
`stats`, `pinned`, `query_window`, `unbounded`, `needs_attention`, `static_scores`, `slot_local`,
`arrival_stat`, `reads_keys`, `varies_by_layer` and `varies_by_head` (with `own_batch` derived from the
last two), and the methods `layer_budgets` and `head_floor` that say the budget per
layer and the floor per head.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch


@dataclass
class AttentionRequest:
    """Which queries' attention over the cache a policy needs at this step.

    `kind="new"` asks for every query of the current forward (H2O's cumulative score);
    `kind="last"` for the last query of the current forward only (TOVA);
    `kind="window"` asks for the last `size` queries seen so far, even if they arrived in
    earlier forwards (SnapKV's observation window). `stat` names the per-slot
    accumulator that receives the attention mass; `accumulate=False` overwrites it.
    `kind="queries"` asks for no attention at all but for the queries themselves, before the
    rotary embedding (`QueryBatch`, Expected Attention's statistics): those of this forward, or the
    last `size` seen when the forward brings fewer (a decode step).
    """

    kind: str
    stat: str
    size: int = 0
    accumulate: bool = True


@dataclass
class QueryBatch:
    """What a `kind="queries"` request measures, handed to `Policy.absorb` in place of a mass.

    raw: `[b, H_q, m, D]` queries as the model projected them, before the rotary embedding (the
    layer un-rotates what attention used, with the model's own rotary module: `cache/rotary.py`).
    stream: `[m]` their tokens' positions in the stream. rotation: positions `[p]` -> cos, sin
    `[p, rot]` of this layer's rotary embedding (`rot < D`: partial rotary). next_position: where
    the next token's query would be rotated if nothing were evicted (the stream's length, or the
    entries held in position-shift mode), so the score does not depend on the budget.
    """

    raw: torch.Tensor
    stream: torch.Tensor
    rotation: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    next_position: int


@dataclass
class SlotView:
    """What one policy sees of one layer: its rows only.

    positions: `[b, H_kv, n]` original token positions of the slots (all slots are
    valid). The cache may hold slots out of positional order (a decode step fills the
    victim's slot in place); a policy that needs sequence order (SnapKV's pooling) uses
    `in_order` / `from_order` instead of sorting itself. `stats` holds the per-slot
    accumulators the policy declared, `[b, H_kv, n]` float32. `keys` is a callable so
    that policies that do not need keys never pay for slicing them out of the batch.
    `state` is what this policy carries from one step of this layer to the next
    (`Policy.new_state`), owned by the layer; None for a policy that carries nothing.
    """

    positions: torch.Tensor
    seen: int
    budget: int
    layer: int
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    keys: Callable[[], torch.Tensor] | None = None
    _order: torch.Tensor | None = field(default=None, repr=False)
    #: `[b, H_kv, n]` what `Policy.arrival` gave each slot's key when it arrived, where the cache
    #: stored it (a decode step in original positions); None: compute it from `keys()`
    arrival: torch.Tensor | None = None
    #: `[b, H_kv, n, D]` the slots' values, a callable like `keys` (LagKV and Expected Attention read them)
    values: Callable[[], torch.Tensor] | None = None
    state: object | None = None

    def with_budget(self, budget: int) -> SlotView:
        return dataclasses.replace(self, budget=budget)

    def with_state(self, state: object | None) -> SlotView:
        """This view with another policy's state (a wrapper's inner policy, where the wrapper keeps its own)."""
        return dataclasses.replace(self, state=state)

    def order(self) -> torch.Tensor:
        """`[b, H_kv, n]` slot indices sorted by position (computed once per view)."""
        if self._order is None:
            self._order = self.positions.argsort(dim=-1)
        return self._order

    def in_order(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `[b, H_kv, n]` per slot, rearranged so the last axis runs by position."""
        return x.gather(-1, self.order())

    def from_order(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of `in_order`: per-position values `[b, H_kv, n]` back to slot order."""
        return torch.empty_like(x).scatter_(-1, self.order(), x)


@dataclass(eq=False)
class Policy:
    """Base class: subclasses are dataclasses of their options and override `scores`.

    The class attributes below are the whole of what the cache and the harness may
    ask about a policy. Sink wrappers (`SinkWrapper`) forward them from their inner
    policy.
    """

    #: per-slot float accumulators the cache must carry (and gather) for this policy
    stats: ClassVar[tuple[str, ...]] = ()
    #: the number of leading tokens this policy guarantees to keep (sink pinning)
    pinned: ClassVar[int] = 0
    #: most recent queries the cache must remember for this policy (SnapKV)
    query_window: ClassVar[int] = 0
    #: never evicts: the cache treats the budget as unbounded (`full`)
    unbounded: ClassVar[bool] = False
    #: what it keeps depends on attention (so it asks for it); otherwise the kept set
    #: follows from positions and keys alone and can be computed ahead of attention
    needs_attention: ClassVar[bool] = False
    #: a token's score is fixed when it arrives (its position or its key decides it) and no
    #: randomness is drawn, so the kept set after any step is the top-budget of all
    #: tokens seen: chunked evaluation computes it in closed form instead of stepping
    static_scores: ClassVar[bool] = False
    #: `scores` treats each slot on its own (its position, its statistics, the view's `seen` and
    #: `budget`), and so does `absorb` of the `"new"` requests it makes (a `"window"` request is
    #: absorbed on the alive slots only): a view holding more slots gives every other slot the same
    #: result. A chunk replay in original positions then scores every slot of the chunk at once and
    #: only masks the evicted ones (`by_slot.steps_by_slot`)
    slot_local: ClassVar[bool] = False
    #: scores slots by their keys (`view.keys()`: knorm, keydiff), so like an attention-driven
    #: policy it can keep token 0 on some heads and lose it on others
    reads_keys: ClassVar[bool] = False
    #: gives each layer its own budget (`layer_budgets`, PyramidKV). The storage of a layer
    #: is one budget for all rows, so such a policy runs in a batch of its own
    varies_by_layer: ClassVar[bool] = False
    #: gives each KV head of a layer its own share of the layer's entries (`head_floor`, Ada-KV).
    #: The layer then stores ragged per-head segments and attends by hand (`cache/per_head/layer.py`),
    #: so such a policy runs in a batch of its own beside the uniform ones
    varies_by_head: ClassVar[bool] = False
    #: evicts on its own schedule (`evict_to`: many entries at once, or below the budget) instead of
    #: one entry whenever the budget is exceeded. Every row of a layer holds the same number of
    #: entries, so such a policy runs in a batch of its own
    own_schedule: ClassVar[bool] = False
    #: reproduces a serving engine's whole rule (`engines.md`): wrappers refuse to wrap it, since
    #: pinning more sinks or sharing its budget across heads is no longer that engine
    preset: ClassVar[bool] = False
    #: on a hybrid model, the budget bounds the sliding-window layers too (llama.cpp's `n_ctx` holds every
    #: layer, and its sliding layers mask by the renumbered positions): they run this policy's schedule
    bounds_every_layer: ClassVar[bool] = False
    #: evicts the oldest entry after its first `fifo_after` tokens (a window, or a window behind
    #: pinned sinks), None for any other rule. Then a decode step's victim is known without
    #: scoring or ranking anything: the layer keeps a ring of slots (`EvictingLayer.finish`)
    fifo_after: ClassVar[int | None] = None
    #: part of its score is a number each key alone decides (`arrival`: K-norm's norm, KeyDiff's
    #: inverse norm). Where stored keys never change (original positions) the cache computes it once
    #: per key, keeps it per slot and hands it back (`SlotView.arrival`), so a decode step does not
    #: recompute it for every held key
    arrival_stat: ClassVar[bool] = False
    #: how the cache holds each kept entry: None (at the model's dtype), or the `StorageForm` of a
    #: `qB+P` spec. A storage form, not a rule: it never changes which entries a policy keeps
    kv_storage: ClassVar[object | None] = None
    #: scored by reconstructing the context after its prefill (KVzip, `kvzip.py`): extra forwards of the
    #: model asked to repeat the context feed its statistic (`eval/reconstruction.py`), then one held-back
    #: eviction keeps the best. It runs only where a context is compressed once (`kvevict.compress`, the
    #: RULER protocols that hold a prefill back); a cache that would evict it inside a forward refuses
    reconstructs: ClassVar[bool] = False
    #: ranks the entries of every layer together at a held-back eviction (KVzip's default): the model keeps
    #: `layers x KV heads x budget` entries, each layer as many of them as rank among the best
    ranks_layers: ClassVar[bool] = False

    @property
    def own_batch(self) -> bool:
        """Whether this policy cannot share a batch with uniform-budget policies: a layer stores one
        budget for all its rows (`varies_by_layer`), one storage layout (`varies_by_head`) and one
        number of entries held (`own_schedule`)."""
        return self.varies_by_layer or self.varies_by_head or self.own_schedule

    @property
    def position_mode(self) -> str | None:
        """The position mode the engine this policy reproduces uses (a name in `position_modes.POSITION_MODES`), or
        None when the policy runs in either. `check_policy` refuses the other mode."""
        return None

    def evict_to(self, budget: int, held: int) -> int | None:
        """How many entries a layer keeps when it holds `held` after a forward (that forward's tokens
        included), or None to keep them all.

        The default is the papers' rule: down to the budget as soon as it is exceeded, one entry per
        decode step. An engine's rule may evict earlier or many at once (llama.cpp's context shift
        drops half of what is not kept); the most a layer ever holds must stay within `budget`.
        """
        return budget if held > budget else None

    def head_floor(self, budget: int) -> int:
        """The fewest entries each KV head keeps when a layer shares `KV heads x budget` entries
        among its heads (Ada-KV's safeguard). A uniform policy keeps exactly `budget` per head."""
        return budget

    def spec(self) -> str:
        raise NotImplementedError

    def check_budget(self, budget: int) -> None:
        """Raise `KvevictError` if this policy cannot run at `budget`."""

    def layer_budgets(self, budget: int, layers: int) -> list[int] | None:
        """Entries each of `layers` layers keeps under a cache budget of `budget` (their sum
        is `layers * budget`), or None when every layer keeps `budget`."""
        return None

    def with_seed(self, seed: int) -> Policy:
        """This policy with its random seed set to `seed` (itself when it draws nothing)."""
        return self

    def with_stream_start(self, adds_bos: bool) -> Policy:
        """This policy as it runs on a model whose tokenizer does (`adds_bos`) or does not put a BOS
        before a text (`data.stream_start`); itself unless an option of it says "the model's"."""
        return self

    def request(self, view: SlotView, will_evict: bool) -> AttentionRequest | None:
        """The attention statistics this policy wants at this step, if any."""
        return None

    def absorb(self, view: SlotView, request: AttentionRequest, mass: torch.Tensor | QueryBatch) -> torch.Tensor:
        """New value of `request.stat` given the attention `mass` `[b, H_kv, n]` just measured (for a
        `kind="queries"` request: the `QueryBatch`, which the policy turns into its statistic)."""
        if request.accumulate:
            return view.stats[request.stat] + mass
        return mass

    def scores(self, view: SlotView) -> torch.Tensor:
        """`[b, H_kv, n]` floats, higher means keep (see the module's score convention)."""
        raise NotImplementedError

    def arrival(self, keys: torch.Tensor) -> torch.Tensor:
        """`[b, H_kv, q]` the per-key number of `arrival_stat`, of keys `[b, H_kv, q, D]`. It must depend
        on each key alone, so computing it for one key or for many gives the same bits."""
        raise NotImplementedError

    def new_state(self, layer: int) -> object | None:
        """A fresh state for one layer (`layer`: its index): what this policy carries from one step
        of that layer to the next (SnapKV's last selection, SinkAuto's calibration, Random's
        generator). The layer owns it, makes it at its first forward and forgets it at a reset,
        and hands it back as `SlotView.state`; the policy object itself never changes during a
        run, so one object serves every layer and every thread. None: nothing to carry."""
        return None

    def __repr__(self) -> str:
        return f"<policy {self.spec()}>"


def held_per_step(policy: Policy, budget: int | None, steps: int) -> list[int]:
    """Entries a full-attention layer holds after each of `steps` one-token steps under `policy`'s
    schedule (`Policy.evict_to`) at `budget`: the memory it actually uses, step by step. Chunked
    evaluation replays the same steps, so this is what any evaluation holds."""
    held, out = 0, []
    for _ in range(steps):
        held += 1
        target = None if budget is None or policy.unbounded else policy.evict_to(budget, held)
        held = held if target is None else target
        out.append(held)
    return out


def recency(view: SlotView) -> torch.Tensor:
    """Position as a float64 score: the most recent slots score highest."""
    return view.positions.to(torch.float64)


def recent_mask(view: SlotView, count: int) -> torch.Tensor:
    """Slots among the `count` most recent tokens seen (by original position)."""
    return view.positions >= view.seen - count
