"""Token-by-token eviction inside one forward of many tokens: chunked exact streaming.

Feeding a stream one token per forward pays the weights and the MLPs per token. A
forward of `q` tokens pays them once, but its queries must still see exactly what
token-by-token feeding would have kept: query `i` attends to the entries alive at its
own step (what was kept after step `i - 1`, plus itself), and the evictions of the
chunk are replayed one step at a time so the next chunk starts from the same kept set.

Two ways to know the alive sets:

* **Closed form** (`replay_static`): when every row's policy declares `static_scores`
  (`window`, `sinkN+window`: a token's score is fixed on arrival), the kept set after
  any step is the top-`budget` of all tokens seen, so every query's alive set follows
  from one ranking; one masked attention for the chunk. Original positions only.
* **Stepping** (`replay_steps`): otherwise (attention-driven policies, random draws,
  position-shift mode) the layer steps through the chunk's queries, doing only what a
  decode step does to the cache: the query's attention over its alive set, the
  policies' statistics, the victim, the hole it leaves. Rows and heads are vectorised.
  Two algorithms share the bookkeeping (`_Stepper`): with fixed keys (original
  positions) the logits are computed once per chunk and each step reads its alive
  slots; with renumbered keys (position shift) each step rotates its keys and attends.

Both keep a *virtual* slot layout, `vslot` `[B, H, budget + 1]` (storage slot of each
slot a token-by-token run would use), so policies see the same views, random draws
land on the same slots, and the final gather leaves the storage exactly as
token-by-token feeding would have.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from ..policies import SlotView
from . import selection
from .layer_settings import Forward, LayerSettings
from .probabilities import attention_mass
from .rows import RowGroup
from .statistics import Statistics, measure
from .storage import SlotStorage


class ReplayingLayer(Protocol):
    """What a replay reads and sets on the layer it runs in (an `EvictingLayer`)."""

    index: int
    n: int
    seen: int
    new: int
    ordered: bool
    batch_size: int
    heads: int
    device: torch.device
    budget: int | None
    storage: SlotStorage
    settings: LayerSettings
    forward: Forward
    statistics: Statistics

    def report_eviction(self, seen: int, kept: torch.Tensor | None, victims: torch.Tensor | None) -> None: ...

    def report_evictions(self, seen: torch.Tensor, victims: torch.Tensor) -> None: ...

    def window_size(self) -> int | None: ...


@dataclass(eq=False)
class StaticPlan:
    """What closed-form replay derives from the ranking alone, shapes `[B, H_kv, ...]`.

    It depends only on the held positions, the scores and the chunk's place in the
    stream, which are the same in every layer for position-decided policies (`window`,
    `sinkN+window`), so the first layer of a chunk computes it and the others reuse it
    through the forward's record (`Forward.static_plan`)
    (checked by equality, never assumed): ~30x less bookkeeping per chunk.
    """

    key: tuple[int, int, int, int | None]  # (held, new, seen, budget)
    pos: torch.Tensor  # [B, H, total] positions by slot (a copy: storage changes after)
    scores: torch.Tensor  # [B, H, total]
    alive: torch.Tensor  # [B, H, q, total] what query i sees
    after: torch.Tensor  # [B, H, q, total] kept after step i
    evicting: torch.Tensor  # [q] steps that evict
    keep: torch.Tensor  # [B, H, budget] slots held at the end
    victims: torch.Tensor | None = None  # [B, H, q] position each step evicts (made on first use)
    query_mask: torch.Tensor | None = None  # alive per query head, for SDPA (made on first use)
    shift: tuple | None = None  # the position-shift shortcut's terms, or () when it does not apply


def _static_plan(layer: ReplayingLayer, pos: torch.Tensor, scores: torch.Tensor) -> StaticPlan:
    """The plan of this chunk: the previous layer's if it ranked the same tokens the same way.

    With fixed per-token scores, one eviction at a time keeps the top-`budget` of the
    tokens seen (ties keep the later token). Rank every held and new token once; the
    kept set after step `i` is then "rank among {held} + {new tokens <= i} within the
    budget", a cumulative count over the ranking.
    """
    key = (layer.n, layer.new, layer.seen, layer.budget)
    memo = layer.forward.static_plan
    if memo is not None and memo.key == key and torch.equal(memo.pos, pos) and torch.equal(memo.scores, scores):
        return memo
    n0, q, budget = layer.n, layer.new, layer.budget
    b, hkv, total = pos.shape
    # rank: best score first, the later token first among equals
    latest_first = pos.argsort(dim=-1, descending=True, stable=True)
    ranked = torch.sort(scores.gather(-1, latest_first), dim=-1, descending=True, stable=True).indices
    by_rank = latest_first.gather(-1, ranked)  # [B, H, total] slots, best first
    step_of = (torch.arange(total, device=pos.device) - n0).clamp(min=-1)  # chunk step of each slot, -1 held
    steps = torch.arange(q, device=pos.device)
    member = step_of[by_rank][:, :, None, :] <= steps[:, None]  # [B, H, q, total] in rank order
    within = member & (member.to(torch.int32).cumsum(dim=-1) <= budget)
    after = torch.zeros(b, hkv, q, total, dtype=torch.bool, device=pos.device)
    after.scatter_(-1, by_rank[:, :, None, :].expand(-1, -1, q, -1), within)  # kept after step i, by slot
    alive = torch.cat([(step_of < 0).expand(b, hkv, 1, total), after[:, :, :-1]], dim=2)
    alive[:, :, steps, n0 + steps] = True  # each query sees itself
    plan = StaticPlan(
        key=key,
        pos=pos.clone(),
        scores=scores,
        alive=alive,
        after=after,
        evicting=steps >= max(0, budget - n0),
        keep=pos.masked_fill(~after[:, :, -1], selection.LATEST_LAST).argsort(dim=-1)[..., :budget],
    )
    layer.forward.static_plan = plan
    return plan


def replay_static(
    layer: ReplayingLayer, query: torch.Tensor, used: torch.Tensor, scaling: float
) -> torch.Tensor | None:
    """Closed-form replay for static scores. Returns the output `[B, H_q, q, D]`, or None
    (nothing changed) when position-shift mode's shortcut does not apply.
    """
    storage, budget = layer.storage, layer.budget
    n0, q = layer.n, layer.new
    total = n0 + q
    first_seen = layer.seen - q
    pos = storage.pos[:, :, :total]
    plan = _static_plan(layer, pos, _scores(layer, pos, first_seen + q, total))
    attention = layer.settings.mode.by_keys(_fixed_static_attention, _shifted_static_attention)
    out = attention(layer, query, used, scaling, plan)
    if out is None:
        return None
    if layer.settings.observers:
        steps = plan.evicting.nonzero()[:, 0]
        layer.report_evictions(first_seen + 1 + steps, _victims(plan)[:, :, steps])
    layer.settings.mode.compact(storage, plan.keep, budget)
    layer.ordered = True
    layer.n = budget
    return out


def _victims(plan: StaticPlan) -> torch.Tensor:
    """`[B, H, q]` the position each step of the chunk evicts (made once per plan)."""
    if plan.victims is None:
        plan.victims = plan.pos.gather(-1, (plan.alive & ~plan.after).float().argmax(dim=-1))
    return plan.victims


def _fixed_static_attention(
    layer: ReplayingLayer, query: torch.Tensor, used: torch.Tensor, scaling: float, plan: StaticPlan
) -> torch.Tensor:
    """Keys that keep their rotation: one SDPA for the chunk, each query masked to what was alive at its step."""
    storage, total = layer.storage, layer.n + layer.new
    group = query.shape[1] // layer.heads
    if plan.query_mask is None:
        plan.query_mask = plan.alive.repeat_interleave(group, dim=1) if group > 1 else plan.alive
    return F.scaled_dot_product_attention(
        query, storage.keys[:, :, :total], storage.values[:, :, :total], attn_mask=plan.query_mask,
        scale=scaling, enable_gqa=group > 1,
    )


def _shift_terms(layer: ReplayingLayer, plan: StaticPlan) -> tuple:
    """The position-shift shortcut's terms for `plan`, or `()` when the chunk lacks its shape.

    In position-shift mode query `i` sits at `n_i` (the entries it sees, less itself)
    and a key at its rank among them, so ranks move as entries leave. When each step
    evicts the oldest entry outside a fixed set `S` of older, never-evicted ones (the
    sinks: `window`, `sinkN+window`), every other key's rank drops by one per eviction,
    so the relative distance `n_i - rank` equals `Q_i - P_j` with `Q_i = n_i + E(i)`
    (`E(i)`: evictions before step `i`) and `P_j` fixed per key. Returns
    `(pinned [B, H, total], width, n_i [q], Q_i [q], P_j [total])`.
    """
    n0, q, budget = layer.n, layer.new, layer.budget
    device = plan.pos.device
    never = selection.LATEST_LAST
    step_of = (torch.arange(n0 + q, device=device) - n0).clamp(min=-1)
    victims = _victims(plan)
    first_victim = victims.masked_fill(~plan.evicting, never).amin(dim=-1)  # [B, H]
    pinned = (step_of < 0) & (plan.pos < first_victim[..., None])  # S: held, older than every victim
    oldest = plan.pos[:, :, None, :].masked_fill(~plan.alive | pinned[:, :, None, :], never).amin(dim=-1)
    if not bool(((oldest == victims) | ~plan.evicting).all()):
        return ()
    steps = torch.arange(q, device=device)
    seen_before = (n0 + steps).clamp(max=budget)  # n_i
    evictions = (steps - max(0, budget - n0)).clamp(min=0)  # E(i)
    slot_rank = torch.cat([torch.arange(n0, device=device), seen_before + evictions])  # P_j, by slot
    # S is a few of the oldest held slots (the sinks): their logits need the other query rotation
    width = int(pinned.any(dim=(0, 1)).nonzero().max()) + 1 if bool(pinned.any()) else 0
    return pinned, width, seen_before, seen_before + evictions, slot_rank


def _shifted_static_attention(
    layer: ReplayingLayer, query: torch.Tensor, used: torch.Tensor, scaling: float, plan: StaticPlan
) -> torch.Tensor | None:
    """Position-shift attention of a chunk whose every step evicts the oldest unpinned
    entry (see `_shift_terms`): two rotations of the queries (for the sinks, and for the
    rest) and one of the keys give every logit exactly. None when the chunk does not
    have that shape (then it is stepped).
    """
    if plan.shift is None:
        plan.shift = _shift_terms(layer, plan)
    if not plan.shift:
        return None
    pinned, width, seen_before, query_at, slot_rank = plan.shift
    storage, mode = layer.storage, layer.settings.mode
    n0, q = layer.n, layer.new
    b, hq, _, d = query.shape
    hkv = layer.heads
    group = hq // hkv
    raw_query = mode.rotary.unrotate(query, *mode.rotary.at(used))
    keys = mode.rotary.rotate(storage.raw[:, :, : n0 + q], *mode.rotary.at(slot_rank))
    grouped = raw_query.reshape(b, hkv, group, q, d)
    logits = torch.einsum("bhgqd,bhnd->bhgqn", mode.rotary.rotate(grouped, *mode.rotary.at(query_at)), keys)
    if width:
        at_pinned = torch.einsum(
            "bhgqd,bhnd->bhgqn", mode.rotary.rotate(grouped, *mode.rotary.at(seen_before)), keys[:, :, :width]
        )
        logits[..., :width] = torch.where(pinned[:, :, None, None, :width], at_pinned, logits[..., :width])
    logits = logits.float() * scaling
    logits.masked_fill_(~plan.alive[:, :, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1).to(storage.values.dtype)
    return torch.einsum("bhgqn,bhnd->bhgqd", probs, storage.values[:, :, : n0 + q]).reshape(b, hq, q, d)


def replay_steps(layer: ReplayingLayer, query: torch.Tensor, used: torch.Tensor, scaling: float) -> torch.Tensor:
    """Step through the chunk's queries: attention, statistics and one eviction per step.

    query `[B, H_q, q, D]` as the model rotated it, at positions `used` `[q]`. Returns
    the output `[B, H_q, q, D]`.
    """
    if layer.settings.mode.by_keys(True, False) and _by_slot_applies(layer):
        return _steps_by_slot(layer, query, used, scaling)
    steps = layer.settings.mode.by_keys(_steps_fixed_keys, _steps_renumbered)
    return steps(layer, query, used, scaling)


def _by_slot_applies(layer: ReplayingLayer) -> bool:
    """Whether `_steps_by_slot` replays this chunk: every row's policy is static or slot-local
    (`Policy.slot_local`), and each step that evicts evicts exactly one entry."""
    layout = layer.settings.layout
    if not all(g.policy.static_scores or g.policy.slot_local for g in layout.groups):
        return False
    k = layer.n
    for _ in range(layer.new):
        target = layout.evict_to(layer.budget, k + 1)
        if target is not None and target != k:
            return False
        k = k + 1 if target is None else target
    return True


def _steps_by_slot(layer: ReplayingLayer, query: torch.Tensor, used: torch.Tensor, scaling: float) -> torch.Tensor:
    """Original positions, every policy static or slot-local: step through the chunk on all
    `n0 + q` slots at once, in position order, masking the evicted ones.

    A slot-local policy scores a slot from that slot alone, so scoring every slot of the
    chunk (`[B, H, n0 + q]`, the not-yet-arrived and the evicted masked `+inf`) picks the
    victim a token-by-token step picks from its `budget + 1` entries; in position order
    `argmin` takes the earliest of equal minima, the cache's tie rule, with no second pass.
    A step costs a softmax of one query over the chunk's logits (for rows that ask for
    "new" attention), the policies' scores and one argmin for every row together; a
    "window" request (SnapKV's re-selection, every `interval` tokens) is measured and
    absorbed on the exact alive slots, as a decode step would. The chunk ends with one
    masked SDPA and one compaction, in positional order.
    """
    storage, layout, budget = layer.storage, layer.settings.layout, layer.budget
    n0, q = layer.n, layer.new
    total = n0 + q
    b, hq, _, d = query.shape
    hkv = layer.heads
    group_size = hq // hkv
    device = layer.device
    first_seen = layer.seen - q
    # position order: held slots sorted by position, then the chunk's (already in order)
    held_order = storage.pos[:, :, :n0].argsort(dim=-1)
    order = torch.cat([held_order, torch.arange(n0, total, device=device).expand(b, hkv, q)], dim=-1)
    positions = storage.pos[:, :, :total].gather(-1, order)  # [B, H, total], increasing
    stats = {name: stat[:, :, :total].gather(-1, order) for name, stat in storage.stats.items()}
    keys = None  # [B, H, total, D] in position order, made on first use

    def sorted_keys() -> torch.Tensor:
        nonlocal keys
        if keys is None:
            keys = _take_slots(storage.keys, order)
        return keys

    stepping = [g for g in layout.groups if not g.policy.static_scores]
    fixed = None
    if len(stepping) < len(layout.groups):
        fixed = _scores(layer, storage.pos[:, :, :total], first_seen + q, total, static_only=True).gather(-1, order)
    grouped = query.reshape(b, hkv, group_size, q, d)
    logits: dict[int, torch.Tensor] = {}  # group -> [b_g, H, g, q, total] logits of its rows, on first use

    def new_mass(index: int, group: RowGroup, i: int) -> torch.Tensor:
        if index not in logits:
            logits[index] = torch.einsum(
                "bhgqd,bhnd->bhgqn", group.take(grouped), group.take(sorted_keys())
            ).float() * scaling
        logit = logits[index][:, :, :, i].masked_fill(group.take(gone)[:, :, None], float("-inf"))
        return torch.softmax(logit, dim=-1).sum(dim=2)  # one query: its attention is "new" and "last"

    gone = torch.zeros(b, hkv, total, dtype=torch.bool, device=device)  # not alive: yet to arrive, or evicted
    gone[:, :, n0:] = True
    statistics, remembered = layer.statistics, 0
    # With a query window (SnapKV), the slots a token-by-token run would use are kept too (the newest
    # fills the victim's place, as a decode step does), so a re-selection measures and pools the same
    # keys in the same order as that run, and the chunk ends in that layout.
    layered = bool(statistics.window_size)
    if layered:
        vslot = torch.empty(b, hkv, budget + 1, dtype=torch.long, device=device)  # position-order index per slot
        vslot[:, :, :n0] = torch.empty_like(order).scatter_(-1, order, torch.arange(total, device=device).expand(
            b, hkv, -1))[:, :, :n0]
        where = torch.empty(b, hkv, total, dtype=torch.long, device=device)  # slot of each position-order index
        where.scatter_(-1, vslot[:, :, :n0], torch.arange(n0, device=device).expand(b, hkv, -1))
    victims: list[torch.Tensor] = []
    evicting: list[int] = []
    k = n0
    for i in range(q):
        gone[:, :, n0 + i] = False
        if layered:
            vslot[:, :, k] = n0 + i
            where[:, :, n0 + i] = k
        seen = first_seen + i + 1
        target = layout.evict_to(budget, k + 1)
        will_evict = target is not None
        for index, g in enumerate(stepping):
            view = _full_view(layer, g, positions, stats, seen, sorted_keys)
            request = g.policy.request(view, will_evict)
            if request is None:
                continue
            if request.kind == "window":  # measured and absorbed on the alive slots only
                remembered = _remember(statistics, query, used, remembered, i + 1, first_seen)
                held = g.take(vslot[:, :, : k + 1])
                view = _alive_view(layer, g, positions, stats, seen, sorted_keys, held)
            mass = measure(
                request,
                new=lambda index=index, g=g, i=i: new_mass(index, g, i),
                window=lambda size, g=g, view=view, seen=seen, n=k + 1: _window_mass(
                    layer, g, view, size, seen, n, scaling
                ),
            )
            updated = g.policy.absorb(view, request, mass)
            stat = stats[request.stat]
            if request.kind == "window":
                updated = g.take(stat).scatter(-1, held, updated.to(stat.dtype))
            g.put(stat, updated.to(stat.dtype))
        if not will_evict:
            k += 1
            continue
        scores = torch.zeros(b, hkv, total, dtype=torch.float64, device=device) if fixed is None else fixed.clone()
        for g in stepping:
            g.put(scores, g.policy.scores(_full_view(layer, g, positions, stats, seen, sorted_keys)))
        victim = scores.masked_fill_(gone, float("inf")).argmin(dim=-1)  # [B, H] earliest of the lowest
        gone.scatter_(-1, victim[..., None], True)
        if layered:  # the newest entry (slot k) moves into the victim's slot
            hole = where.gather(-1, victim[..., None])
            vslot.scatter_(-1, hole, vslot[:, :, k : k + 1].clone())  # a slice of itself: copied
            where[:, :, n0 + i] = hole[..., 0]
        victims.append(victim)
        evicting.append(i)
        k = target
    _remember(statistics, query, used, remembered, q, first_seen)
    # query i sees the slots that arrived by step i and were not evicted before it
    arrive = (torch.arange(total, device=device) - n0).clamp(min=-1)
    leave = torch.full((b, hkv, total), q, dtype=torch.long, device=device)
    if victims:
        victim_slots = torch.stack(victims, dim=-1)  # [B, H, E] in position order
        steps = torch.tensor(evicting, device=device)
        leave.scatter_(-1, victim_slots, steps.expand(b, hkv, -1))
        if layer.settings.observers:
            layer.report_evictions(first_seen + 1 + steps, positions.gather(-1, victim_slots))
    step_ids = torch.arange(q, device=device)[:, None]
    alive = (arrive <= step_ids) & (step_ids <= leave[:, :, None, :])  # [B, H, q, total] in position order
    mask = torch.empty_like(alive).scatter_(-1, order[:, :, None, :].expand(-1, -1, q, -1), alive)
    if group_size > 1:
        mask = mask.repeat_interleave(group_size, dim=1)
    out = F.scaled_dot_product_attention(
        query, storage.keys[:, :, :total], storage.values[:, :, :total], attn_mask=mask, scale=scaling,
        enable_gqa=group_size > 1,
    )
    for name, stat in stats.items():
        storage.stats[name][:, :, :total].scatter_(-1, order, stat)
    if layered:  # storage slots in the token-by-token layout
        keep = order.gather(-1, vslot[:, :, :k])
    else:  # storage slots in positional order
        keep = order.gather(-1, (~gone).nonzero()[:, -1].view(b, hkv, k))
    layer.settings.mode.compact(storage, keep, k)
    layer.ordered = not layered
    layer.n = k
    return out


def _remember(statistics: Statistics, query: torch.Tensor, used: torch.Tensor, start: int, stop: int,
              first_seen: int) -> int:
    """Write the chunk's queries `start..stop-1` into the query window, in pieces no longer than the
    window (so each lands in the slot a one-query step would write). Returns `stop`."""
    size = statistics.window_size
    if size:
        for lo in range(start, stop, size):
            hi = min(lo + size, stop)
            statistics.remember(query[:, :, lo:hi], used[lo:hi], first_seen + hi)
    return stop


def _full_view(layer: ReplayingLayer, group: RowGroup, positions: torch.Tensor, stats: dict, seen: int,
               keys) -> SlotView:
    """`group`'s view of every slot of the chunk, in position order (for slot-local policies)."""
    return SlotView(
        positions=group.take(positions), seen=seen, budget=layer.budget, layer=layer.index,
        stats={name: group.take(stats[name]) for name in group.policy.stats},
        keys=lambda: group.take(keys()),
    )


def _alive_view(layer: ReplayingLayer, group: RowGroup, positions: torch.Tensor, stats: dict, seen: int,
                keys, alive: torch.Tensor) -> SlotView:
    """`group`'s view of its alive slots `alive` `[b_g, H, k]` (indices in position order)."""
    return SlotView(
        positions=group.take(positions).gather(-1, alive), seen=seen, budget=layer.budget, layer=layer.index,
        stats={name: group.take(stats[name]).gather(-1, alive) for name in group.policy.stats},
        keys=lambda: _take_slots(group.take(keys()), alive),
    )


def _window_mass(
    layer: ReplayingLayer, group: RowGroup, view: SlotView, size: int, seen: int, total: int, scaling: float
) -> torch.Tensor:
    """The last `size` queries, rotated to where their tokens sit now (`window_queries`: in original positions
    where they were rotated), over `view`'s keys. Both stepping algorithms and `_steps_by_slot` measure here."""
    queries, q_pos = layer.statistics.window_queries(layer.settings.mode, size, seen, total)
    return attention_mass(group.take(queries), q_pos, view.keys(), view.positions, scaling)


class _Stepper:
    """What both stepping algorithms share: the virtual slots, the policies' statistics at each
    step, and the step's eviction. The algorithms differ only in how a step attends."""

    def __init__(self, layer: ReplayingLayer, scaling: float) -> None:
        self.layer, self.scaling = layer, scaling
        storage, groups = layer.storage, layer.settings.layout.groups
        n0, q = layer.n, layer.new
        self.first_seen = layer.seen - q
        self.vslot = torch.empty(layer.batch_size, layer.heads, layer.budget + 1, dtype=torch.long, device=layer.device)
        self.vslot[:, :, :n0] = torch.arange(n0, device=layer.device)
        self.k = n0  # entries a token-by-token run holds before the step
        self.evicted = False
        # Rows of static policies need no statistics and no calls per step: their scores
        # over every slot of the chunk are computed once and read through the virtual slots.
        self.stepping = [g for g in groups if not g.policy.static_scores]
        self.fixed = None
        if len(self.stepping) < len(groups):
            self.fixed = _scores(layer, storage.pos[:, :, : n0 + q], self.first_seen + q, n0 + q, static_only=True)
        self.wants_probs = any(g.policy.needs_attention for g in self.stepping)

    def begin(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Step `i` arrives: its token takes the next virtual slot. Returns the slots alive `[B, H, total]`,
        their positions, and the tokens seen after the step."""
        layer = self.layer
        self.vslot[:, :, self.k] = layer.n + i
        slots = self.vslot[:, :, : self.k + 1]
        return slots, layer.storage.pos.gather(-1, slots), self.first_seen + i + 1

    def end(
        self,
        slots: torch.Tensor,
        positions: torch.Tensor,
        seen: int,
        keys: torch.Tensor | None,
        probs: torch.Tensor | None,
        query: torch.Tensor,
        query_positions: torch.Tensor,
    ) -> torch.Tensor | None:
        """The policies' statistics of the step, then its eviction. keys `[B, H, total, D]` as the step
        sees them (None: the stored ones), probs `[B, H, g, total]` the step query's attention.
        Returns the victim slot index `[B, H]` (into `slots`) when the step evicts one entry, else None:
        a step that evicts several (the rows' schedule, `Policy.evict_to`: an engine's burst, whole
        pages) compacts the virtual slots in positional order here, as a compaction does."""
        layer, storage, budget = self.layer, self.layer.storage, self.layer.budget
        total = slots.shape[-1]
        layer.statistics.remember(query, query_positions, seen)
        target = layer.settings.layout.evict_to(budget, total)
        will_evict = target is not None
        views = [_view(layer, g, positions, slots, seen, budget, storage, keys) for g in self.stepping]
        for g, view in zip(self.stepping, views):
            request = g.policy.request(view, will_evict)
            if request is None:
                continue
            mass = measure(
                request,
                new=lambda g=g: g.take(probs.sum(dim=2)),  # one query per step: its attention is "new" and "last"
                window=lambda size, g=g, view=view: _window_mass(layer, g, view, size, seen, total, self.scaling),
                queries=lambda size, g=g: layer.statistics.query_batch(  # the step's query remembered above
                    layer.settings.mode, size, layer.settings.mode.seq_length(total, seen), g.take
                ),
            )
            stat = storage.stats[request.stat]
            updated = g.policy.absorb(view, request, mass).to(stat.dtype)
            g.put(stat, g.take(stat).scatter(-1, g.take(slots), updated))
            view.stats[request.stat] = updated
        layer.statistics.last_forward = None  # served: the step's query is not held past it
        if not will_evict:
            self.k += 1
            return None
        self.evicted = True
        b, hkv = slots.shape[:2]
        if self.fixed is None:
            parts = [g.policy.scores(v) for g, v in zip(self.stepping, views)]
            scores = layer.settings.layout.merge(parts, b, hkv, total)
        else:
            scores = self.fixed.gather(-1, slots)
            for g, v in zip(self.stepping, views):
                g.put(scores, g.policy.scores(v))
        self.k = target
        if target < total - 1:
            keep = selection.keep_slots(scores, positions, target, ordered=False)
            self.vslot[:, :, :target] = slots.gather(-1, keep)
            layer.report_eviction(seen, positions.gather(-1, keep), None)
            return None
        victim = selection.victim(scores, positions, ordered=False)
        layer.report_eviction(seen, None, positions.gather(-1, victim[..., None])[..., 0])
        return victim


def _steps_fixed_keys(layer: ReplayingLayer, query: torch.Tensor, used: torch.Tensor, scaling: float) -> torch.Tensor:
    """Original positions: a stored key never changes, so every query's logits over every slot
    it could see are computed once for the chunk, each step reads its alive slots from them,
    and the output is one masked softmax at the end. A step that evicts moves the newest
    slot into the victim's place (as a decode step does)."""
    storage = layer.storage
    n0, q = layer.n, layer.new
    b, hq, _, d = query.shape
    hkv = layer.heads
    group = hq // hkv
    step = _Stepper(layer, scaling)
    total_all = n0 + q
    logits = torch.einsum(
        "bhgqd,bhnd->bhgqn", query.reshape(b, hkv, group, q, d), storage.keys[:, :, :total_all]
    ).float() * scaling  # [B, H_kv, g, q, n0 + q]
    alive = torch.zeros(b, hkv, q, total_all, dtype=torch.bool, device=layer.device)
    for i in range(q):
        slots, positions, seen = step.begin(i)
        alive[:, :, i].scatter_(-1, slots, True)
        probs = None
        if step.wants_probs:
            logit = logits[:, :, :, i].gather(-1, slots[:, :, None, :].expand(-1, -1, group, -1))
            probs = torch.softmax(logit, dim=-1)  # [B, H_kv, g, total]
        victim = step.end(slots, positions, seen, None, probs, query[:, :, i : i + 1], used[i : i + 1])
        if victim is not None:  # the newest slot (now just past the kept ones) fills the victim's place
            # the source copied: a slice of the tensor being written (refused by torch where it sees it)
            step.vslot.scatter_(-1, victim[..., None], step.vslot[:, :, step.k : step.k + 1].clone())
    logits.masked_fill_(~alive[:, :, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1).to(storage.values.dtype)  # [B, H_kv, g, q, n0 + q]
    result = torch.einsum("bhgqn,bhnd->bhgqd", probs, storage.values[:, :, :total_all]).reshape(b, hq, q, d)
    layer.settings.mode.compact(storage, step.vslot[:, :, : step.k], step.k)
    if step.evicted:
        layer.ordered = False
    layer.n = step.k
    return result


def _steps_renumbered(layer: ReplayingLayer, query: torch.Tensor, used: torch.Tensor, scaling: float) -> torch.Tensor:
    """Position shift: the kept entries are renumbered `0..k-1` at every step, so each step
    rotates the un-rotated keys to their slots and its query to `k`, and attends on its own.
    A step that evicts compacts the virtual slots (positional order is kept)."""
    storage, mode = layer.storage, layer.settings.mode
    b, hq, q, d = query.shape
    hkv = layer.heads
    group = hq // hkv
    step = _Stepper(layer, scaling)
    raw_query = mode.rotary.unrotate(query, *mode.rotary.at(used))
    window = layer.window_size()  # a sliding layer that runs an engine's schedule masks its band
    outs = []
    for i in range(q):
        slots, positions, seen = step.begin(i)
        total, k = slots.shape[-1], step.k
        cos, sin = mode.rotary.table(total)
        keys = mode.rotary.rotate(_take_slots(storage.raw, slots), cos, sin)
        q_i = mode.rotary.rotate(raw_query[:, :, i : i + 1], cos[k : k + 1], sin[k : k + 1])
        logit = torch.bmm(q_i.reshape(b * hkv, group, d), keys.reshape(b * hkv, total, d).transpose(1, 2))
        if window is not None and total > window:  # a sliding layer under an engine's schedule: its band
            logit[..., : total - window] = float("-inf")
        probs = torch.softmax(logit.float().mul_(scaling), dim=-1).view(b, hkv, group, total)
        values = _take_slots(storage.values, slots)
        out = torch.bmm(probs.to(values.dtype).view(b * hkv, group, total), values.reshape(b * hkv, total, d))
        outs.append(out.view(b, hq, 1, d))
        victim = step.end(slots, positions, seen, keys, probs, q_i, torch.tensor([k], device=layer.device))
        if victim is not None:  # compaction keeps positional order
            keep = torch.arange(step.k, device=layer.device)
            step.vslot[:, :, : step.k] = slots.gather(-1, keep + (keep >= victim[..., None]).long())
    mode.compact(storage, step.vslot[:, :, : step.k], step.k)
    layer.n = step.k
    return torch.cat(outs, dim=2)


def _take_slots(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`buffer` `[B, H, capacity, D]` at `slots` `[B, H, m]` -> `[B, H, m, D]`."""
    return buffer.gather(2, slots[..., None].expand(-1, -1, -1, buffer.shape[-1]))


def _view(
    layer: ReplayingLayer,
    group: RowGroup,
    positions: torch.Tensor,
    slots: torch.Tensor,
    seen: int,
    budget: int,
    storage,
    keys: torch.Tensor | None,
) -> SlotView:
    """What `group`'s policy sees at one step: the virtual slots, in token-by-token order."""
    if keys is None:
        def keys_now() -> torch.Tensor:
            return group.take(_take_slots(storage.keys, slots))
    else:
        def keys_now() -> torch.Tensor:
            return group.take(keys)
    return SlotView(
        positions=group.take(positions),
        seen=seen,
        budget=budget,
        layer=layer.index,
        stats={name: group.take(storage.stats[name]).gather(-1, group.take(slots)) for name in group.policy.stats},
        keys=keys_now,
        values=lambda: group.take(_take_slots(storage.values, slots)),
    )


def _scores(
    layer: ReplayingLayer, pos: torch.Tensor, seen: int, total: int, static_only: bool = False
) -> torch.Tensor:
    """Scores of every group's rows over all `total` slots (static policies: the position or
    the key of a token decides its score).

    `static_only`: score the static groups only; the other rows hold zeros.
    """
    layout = layer.settings.layout
    parts = [
        None if static_only and not group.policy.static_scores
        else group.policy.scores(
            SlotView(
                positions=group.take(pos), seen=seen, budget=layer.budget, layer=layer.index,
                keys=lambda group=group: group.take(layer.storage.keys[:, :, :total]),  # `knorm`: fixed per key
            )
        )
        for group in layout.groups
    ]
    return layout.merge(parts, layer.batch_size, layer.heads, total)
