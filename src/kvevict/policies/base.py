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
know about a policy is its `Policy.capabilities` (`capabilities.Capabilities`, one object),
never read off its name, with the methods `layer_budgets` and `head_floor` that say the budget
per layer and the floor per head.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .capabilities import Capabilities, gather


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
    layer un-rotates what attention used, with the model's own rotary module: `cache/positions/rotary.py`).
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
    `held_back`: the forward in flight reads part of a context whose eviction waits until all of it
    is read (`EvictingCache.defer`; a prompt read in chunks, `kvevict.compress(..., chunk=N)`), so a
    policy that summarises the whole context (Expected Attention's queries) gathers from every forward.
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
    held_back: bool = False

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

    What the cache and the harness may ask about a policy is its `capabilities`
    (`capabilities.Capabilities`, one object). A policy declares what differs from the defaults as
    class attributes named like its fields (`static_scores = True`), or properties where an option
    decides (SnapKV's `query_window`); wrappers derive theirs from their inner policy's (`Wrapper.wrap`).
    Each field also reads as an attribute of the policy (`policy.static_scores`).
    """

    @functools.cached_property
    def capabilities(self) -> Capabilities:
        """Everything this policy declares, gathered once (the object never changes during a run)."""
        return gather(self)

    @property
    def own_batch(self) -> bool:
        """Whether this policy cannot share a batch with uniform-budget policies (`Capabilities.own_batch`)."""
        return self.capabilities.own_batch

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


# the defaults a policy declares nothing against: one per field of `Capabilities`, read as class attributes
for _field in dataclasses.fields(Capabilities):
    setattr(Policy, _field.name, _field.default)
del _field


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
