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
  decode step does to the cache: the query's attention over its alive set (from
  logits computed once per chunk in original-position mode), the policies'
  statistics, the victim, the hole it leaves. Rows and heads are vectorised.

Both keep a *virtual* slot layout, `vslot` `[B, H, budget + 1]` (storage slot of each
slot a token-by-token run would use), so policies see the same views, random draws
land on the same slots, and the final gather leaves the storage exactly as
token-by-token feeding would have.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from ..policies import SlotView
from . import selection
from .layer_settings import LayerSettings
from .probabilities import attention_mass
from .rows import RowGroup
from .statistics import Statistics
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
    statistics: Statistics

    def report_eviction(self, seen: int, kept: torch.Tensor | None, victims: torch.Tensor | None) -> None: ...


def replay_static(
    layer: ReplayingLayer, query: torch.Tensor, used: torch.Tensor, scaling: float
) -> torch.Tensor | None:
    """Closed-form replay for static scores. Returns the output `[B, H_q, q, D]`, or None
    (nothing changed) when position-shift mode's shortcut does not apply.

    With fixed per-token scores, one eviction at a time keeps the top-`budget` of the
    tokens seen (ties keep the later token). Rank every held and new token once; the
    kept set after step `i` is then "rank among {held} + {new tokens <= i} within the
    budget", a cumulative count over the ranking.
    """
    storage, budget = layer.storage, layer.budget
    n0, q = layer.n, layer.new
    total = n0 + q
    first_seen = layer.seen - q
    b, hkv = layer.batch_size, layer.heads
    pos = storage.pos[:, :, :total]
    scores = _scores(layer, pos, first_seen + q, total)
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
    before = torch.cat([(step_of < 0).expand(b, hkv, 1, total), after[:, :, :-1]], dim=2)
    alive = before.clone()
    alive[:, :, steps, n0 + steps] = True  # each query sees itself
    evicting = steps >= max(0, budget - n0)  # [q] steps that overflow the budget
    victims = None  # [B, H, q] what each step evicted: only observers and the position shift need it
    if layer.settings.observers or layer.settings.mode.raw_keys:
        victims = pos.gather(-1, (alive & ~after).float().argmax(dim=-1))
    if layer.settings.mode.raw_keys:
        out = _shifted_static_attention(layer, query, used, scaling, pos, step_of, alive, victims, evicting)
        if out is None:
            return None
    else:
        group = query.shape[1] // hkv
        mask = alive.repeat_interleave(group, dim=1) if group > 1 else alive
        out = F.scaled_dot_product_attention(
            query, storage.keys[:, :, :total], storage.values[:, :, :total], attn_mask=mask, scale=scaling,
            enable_gqa=group > 1,
        )
    if victims is not None:
        for i in range(q):
            if evicting[i]:
                layer.report_eviction(first_seen + i + 1, None, victims[:, :, i])
    keep = pos.masked_fill(~after[:, :, -1], selection.LATEST_LAST).argsort(dim=-1)[..., :budget]
    storage.gather(keep, keys=not layer.settings.mode.raw_keys)
    layer.settings.mode.after_compaction(storage, budget)
    layer.ordered = True
    layer.n = budget
    return out


def _shifted_static_attention(
    layer: ReplayingLayer,
    query: torch.Tensor,
    used: torch.Tensor,
    scaling: float,
    pos: torch.Tensor,
    step_of: torch.Tensor,
    alive: torch.Tensor,
    victims: torch.Tensor,
    evicting: torch.Tensor,
) -> torch.Tensor | None:
    """Position-shift attention of a chunk whose every step evicts the oldest unpinned entry.

    In position-shift mode query `i` sits at `n_i` (the entries it sees, less itself)
    and a key at its rank among them, so ranks move as entries leave. When each step
    evicts the oldest entry outside a fixed set `S` of older, never-evicted ones (the
    sinks: `window`, `sinkN+window`), every other key's rank drops by one per eviction,
    so the relative distance `n_i - rank` equals `Q_i - P_j` with `Q_i = n_i + E(i)`
    (`E(i)`: evictions before step `i`) and `P_j` fixed per key: two rotations of the
    queries (for `S`, and for the rest) and one of the keys give every logit exactly.
    Returns None when the chunk does not have that shape (then it is stepped).
    """
    storage, mode, budget = layer.storage, layer.settings.mode, layer.budget
    n0, q = layer.n, layer.new
    b, hq, _, d = query.shape
    hkv = layer.heads
    group = hq // hkv
    device = query.device
    never = selection.LATEST_LAST
    first_victim = victims.masked_fill(~evicting, never).amin(dim=-1)  # [B, H]
    pinned = (step_of < 0) & (pos < first_victim[..., None])  # S: held, older than every victim
    oldest = pos[:, :, None, :].masked_fill(~alive | pinned[:, :, None, :], never).amin(dim=-1)  # [B, H, q]
    if not bool(((oldest == victims) | ~evicting).all()):
        return None
    steps = torch.arange(q, device=device)
    seen_before = (n0 + steps).clamp(max=budget)  # n_i
    evictions = (steps - max(0, budget - n0)).clamp(min=0)  # E(i)
    slot_rank = torch.cat([torch.arange(n0, device=device), seen_before + evictions])  # P_j, by slot
    raw_query = mode.rotary.unrotate(query, *mode.rotary.at(used))
    keys = mode.rotary.rotate(storage.raw[:, :, : n0 + q], *mode.rotary.at(slot_rank))
    grouped = raw_query.reshape(b, hkv, group, q, d)
    logits = torch.einsum("bhgqd,bhnd->bhgqn", mode.rotary.rotate(grouped, *mode.rotary.at(seen_before + evictions)),
                          keys)
    # S is a few of the oldest held slots (the sinks): their logits need the other query rotation
    width = int(pinned.any(dim=(0, 1)).nonzero().max()) + 1 if bool(pinned.any()) else 0
    if width:
        at_pinned = torch.einsum(
            "bhgqd,bhnd->bhgqn", mode.rotary.rotate(grouped, *mode.rotary.at(seen_before)), keys[:, :, :width]
        )
        logits[..., :width] = torch.where(pinned[:, :, None, None, :width], at_pinned, logits[..., :width])
    logits = logits.float() * scaling
    logits.masked_fill_(~alive[:, :, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1).to(storage.values.dtype)
    return torch.einsum("bhgqn,bhnd->bhgqd", probs, storage.values[:, :, : n0 + q]).reshape(b, hq, q, d)


def replay_steps(layer: ReplayingLayer, query: torch.Tensor, used: torch.Tensor, scaling: float) -> torch.Tensor:
    """Step through the chunk's queries: attention, statistics and one eviction per step.

    query `[B, H_q, q, D]` as the model rotated it, at positions `used` `[q]`. Returns
    the output `[B, H_q, q, D]`.
    """
    s, storage, budget = layer.settings, layer.storage, layer.budget
    mode, groups = s.mode, s.layout.groups
    n0, q = layer.n, layer.new
    first_seen = layer.seen - q
    b, hq, _, d = query.shape
    hkv = layer.heads
    group = hq // hkv
    shifted = mode.raw_keys
    vslot = torch.empty(b, hkv, budget + 1, dtype=torch.long, device=layer.device)
    vslot[:, :, :n0] = torch.arange(n0, device=layer.device)
    k = n0
    if shifted:
        raw_query = mode.rotary.unrotate(query, *mode.rotary.at(used))
        outs = []
    else:
        # every query's logits over every slot it could see, once for the chunk: [B, H_kv, g, q, n0 + q]
        total_all = n0 + q
        logits = torch.einsum(
            "bhgqd,bhnd->bhgqn", query.reshape(b, hkv, group, q, d), storage.keys[:, :, :total_all]
        ).float() * scaling
        alive = torch.zeros(b, hkv, q, total_all, dtype=torch.bool, device=layer.device)
    # Rows of static policies need no statistics and no calls per step: their scores
    # over every slot of the chunk are computed once and read through the virtual slots.
    stepping = [g for g in groups if not g.policy.static_scores]
    fixed = None
    if len(stepping) < len(groups):
        fixed = _scores(layer, storage.pos[:, :, : n0 + q], first_seen + q, n0 + q, static_only=True)
    wants_probs = any(g.policy.needs_attention for g in stepping)
    evicted = False
    for i in range(q):
        vslot[:, :, k] = n0 + i
        total, seen = k + 1, first_seen + i + 1
        slots = vslot[:, :, :total]
        positions = storage.pos.gather(-1, slots)
        if shifted:
            # kept entries renumbered 0..k-1 in positional order, the new token at k
            cos, sin = mode.rotary.table(total)
            keys = mode.rotary.rotate(_take_slots(storage.raw, slots), cos, sin)
            q_i = mode.rotary.rotate(raw_query[:, :, i : i + 1], cos[k : k + 1], sin[k : k + 1])
            q_used = torch.tensor([k], device=layer.device)
            logit = torch.bmm(q_i.reshape(b * hkv, group, d), keys.reshape(b * hkv, total, d).transpose(1, 2))
            probs = torch.softmax(logit.float().mul_(scaling), dim=-1).view(b, hkv, group, total)
            values = _take_slots(storage.values, slots)
            out = torch.bmm(probs.to(values.dtype).view(b * hkv, group, total), values.reshape(b * hkv, total, d))
            outs.append(out.view(b, hq, 1, d))
        else:
            alive[:, :, i].scatter_(-1, slots, True)
            probs = None
            if wants_probs:
                logit = logits[:, :, :, i].gather(-1, slots[:, :, None, :].expand(-1, -1, group, -1))
                probs = torch.softmax(logit, dim=-1)  # [B, H_kv, g, total]
            q_i, q_used = query[:, :, i : i + 1], used[i : i + 1]
            keys = None
        layer.statistics.remember(q_i, q_used, seen)
        will_evict = total > budget
        views = [_view(layer, g, positions, slots, seen, budget, storage, keys) for g in stepping]
        requests = [g.policy.request(v, will_evict) for g, v in zip(stepping, views)]
        for g, view, request in zip(stepping, views, requests):
            if request is None:
                continue
            if request.kind in ("new", "last"):  # one query per step: its attention is both
                mass = g.take(probs.sum(dim=2))
            else:  # "window": the last queries, rotated to where their tokens sit now
                queries, q_pos = layer.statistics.window_queries(mode, request.size, seen, total)
                mass = attention_mass(g.take(queries), q_pos, view.keys(), view.positions, scaling)
            stat = storage.stats[request.stat]
            updated = g.policy.absorb(view, request, mass).to(stat.dtype)
            g.put(stat, g.take(stat).scatter(-1, g.take(slots), updated))
            view.stats[request.stat] = updated
        if not will_evict:
            k += 1
            continue
        evicted = True
        if fixed is None:
            scores = s.layout.merge([g.policy.scores(v) for g, v in zip(stepping, views)], b, hkv, total)
        else:
            scores = fixed.gather(-1, slots)
            for g, v in zip(stepping, views):
                g.put(scores, g.policy.scores(v))
        victim = selection.victim(scores, positions, ordered=False)
        layer.report_eviction(seen, None, positions.gather(-1, victim[..., None])[..., 0])
        if shifted:  # compaction keeps positional order
            keep = torch.arange(budget, device=layer.device)
            vslot[:, :, :budget] = slots.gather(-1, keep + (keep >= victim[..., None]).long())
        else:  # the newest slot fills the victim's place
            vslot.scatter_(-1, victim[..., None], vslot[:, :, budget : budget + 1])
    if shifted:
        result = torch.cat(outs, dim=2)
        storage.gather(vslot[:, :, :k], keys=False)
        mode.after_compaction(storage, k)
    else:
        logits.masked_fill_(~alive[:, :, None], float("-inf"))
        probs = torch.softmax(logits, dim=-1).to(storage.values.dtype)  # [B, H_kv, g, q, n0 + q]
        result = torch.einsum("bhgqn,bhnd->bhgqd", probs, storage.values[:, :, : n0 + q]).reshape(b, hq, q, d)
        storage.gather(vslot[:, :, :k])
        if evicted:
            layer.ordered = False
    layer.n = k
    return result


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
