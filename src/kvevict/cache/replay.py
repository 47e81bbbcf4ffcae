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
  from one ranking; one masked attention for the chunk (the position mode's
  `static_attention`: here for original positions, the shift's shortcut in `positions.py`).
* **Stepping** (`replay_steps`): otherwise (attention-driven policies, random draws,
  position-shift mode) the layer steps through the chunk's queries, doing only what a
  decode step does to the cache: the query's attention over its alive set, the
  policies' statistics, the victim, the hole it leaves. Rows and heads are vectorised.
  The algorithms share the bookkeeping (`stepping.Stepper`): with fixed keys (original
  positions, here) the logits are computed once per chunk and each step reads its alive
  slots; with renumbered keys (position shift, `positions.py`) each step rotates its keys
  and attends.

Both keep a *virtual* slot layout, `vslot` `[B, H, budget + 1]` (storage slot of each
slot a token-by-token run would use), so policies see the same views, random draws
land on the same slots, and the final gather leaves the storage exactly as
token-by-token feeding would have.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ..policies import SlotView
from . import selection
from .rows import RowGroup
from .statistics import measure
from .stepping import ReplayingLayer, Stepper, remember_queries, static_scores, take_slots, window_mass


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
    layer.forward = replace(layer.forward, static_plan=plan)
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
    plan = _static_plan(layer, pos, static_scores(layer, pos, first_seen + q, total))
    out = layer.settings.mode.static_attention(layer, query, used, scaling, plan)
    if out is None:
        return None
    if layer.settings.observers:
        steps = plan.evicting.nonzero()[:, 0]
        layer.report_evictions(first_seen + 1 + steps, victims_of(plan)[:, :, steps])
    layer.settings.mode.compact(storage, plan.keep, budget)
    layer.ordered = True
    layer.n = budget
    return out


def victims_of(plan: StaticPlan) -> torch.Tensor:
    """`[B, H, q]` the position each step of the chunk evicts (made once per plan)."""
    if plan.victims is None:
        plan.victims = plan.pos.gather(-1, (plan.alive & ~plan.after).float().argmax(dim=-1))
    return plan.victims


def fixed_static_attention(
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


def replay_steps(layer: ReplayingLayer, query: torch.Tensor, used: torch.Tensor, scaling: float) -> torch.Tensor:
    """Step through the chunk's queries: attention, statistics and one eviction per step, as the
    layer's position mode does it (`PositionMode.replay_steps`).

    query `[B, H_q, q, D]` as the model rotated it, at positions `used` `[q]`. Returns
    the output `[B, H_q, q, D]`.
    """
    return layer.settings.mode.replay_steps(layer, query, used, scaling)


def steps_fixed(layer: ReplayingLayer, query: torch.Tensor, used: torch.Tensor, scaling: float) -> torch.Tensor:
    """Stepping where a stored key keeps its rotation for good (original positions): over every
    slot of the chunk at once when every policy is static or slot-local, else on one virtual slot
    layout (`steps_fixed_keys`)."""
    if _by_slot_applies(layer):
        return _steps_by_slot(layer, query, used, scaling)
    return steps_fixed_keys(layer, query, used, scaling)


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
            keys = take_slots(storage.keys, order)
        return keys

    stepping = [g for g in layout.groups if not g.policy.static_scores]
    fixed = None
    if len(stepping) < len(layout.groups):
        fixed = static_scores(layer, storage.pos[:, :, :total], first_seen + q, total, static_only=True)
        fixed = fixed.gather(-1, order)
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
                remembered = remember_queries(statistics, query, used, remembered, i + 1, first_seen)
                held = g.take(vslot[:, :, : k + 1])
                view = _alive_view(layer, g, positions, stats, seen, sorted_keys, held)
            mass = measure(
                request,
                new=lambda index=index, g=g, i=i: new_mass(index, g, i),
                window=lambda size, g=g, view=view, seen=seen, n=k + 1: window_mass(
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
    remember_queries(statistics, query, used, remembered, q, first_seen)
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


def _full_view(layer: ReplayingLayer, group: RowGroup, positions: torch.Tensor, stats: dict, seen: int,
               keys) -> SlotView:
    """`group`'s view of every slot of the chunk, in position order (for slot-local policies)."""
    return SlotView(
        positions=group.take(positions), seen=seen, budget=layer.budget, layer=layer.index,
        stats={name: group.take(stats[name]) for name in group.policy.stats},
        keys=lambda: group.take(keys()), state=layer.state_of(group.policy),
    )


def _alive_view(layer: ReplayingLayer, group: RowGroup, positions: torch.Tensor, stats: dict, seen: int,
                keys, alive: torch.Tensor) -> SlotView:
    """`group`'s view of its alive slots `alive` `[b_g, H, k]` (indices in position order)."""
    return SlotView(
        positions=group.take(positions).gather(-1, alive), seen=seen, budget=layer.budget, layer=layer.index,
        stats={name: group.take(stats[name]).gather(-1, alive) for name in group.policy.stats},
        keys=lambda: take_slots(group.take(keys()), alive), state=layer.state_of(group.policy),
    )


def steps_fixed_keys(layer: ReplayingLayer, query: torch.Tensor, used: torch.Tensor, scaling: float) -> torch.Tensor:
    """Original positions: a stored key never changes, so every query's logits over every slot
    it could see are computed once for the chunk, each step reads its alive slots from them,
    and the output is one masked softmax at the end. A step that evicts moves the newest
    slot into the victim's place (as a decode step does)."""
    storage = layer.storage
    n0, q = layer.n, layer.new
    b, hq, _, d = query.shape
    hkv = layer.heads
    group = hq // hkv
    step = Stepper(layer, scaling)
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
