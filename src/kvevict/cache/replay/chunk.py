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
  `static_attention`: here for original positions, the shift's shortcut in `positions/modes.py`).
* **Stepping** (`replay_steps`): otherwise (attention-driven policies, random draws,
  position-shift mode) the layer steps through the chunk's queries, doing only what a
  decode step does to the cache: the query's attention over its alive set, the
  policies' statistics, the victim, the hole it leaves. Rows and heads are vectorised.
  The algorithms share the bookkeeping (`stepping.Stepper`): with fixed keys (original
  positions, here) the logits are computed once per block of queries (within the layer's
  workspace) and each step reads its alive slots; with renumbered keys (position shift,
  `positions/modes.py`) each step rotates its keys and attends.

Both keep a *virtual* slot layout, `vslot` `[B, H, budget + 1]` (storage slot of each
slot a token-by-token run would use), so policies see the same views, random draws
land on the same slots, and the final gather leaves the storage exactly as
token-by-token feeding would have.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ...attention_stats import QueryRows, products, softmax
from ..statistics.probabilities import bound
from ..step import selection
from .stepping import Replayed, ReplayingLayer, Stepper, static_scores


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
    # Position-decided scores over slots every row and head fills alike (a uniform layer's window) rank the
    # same in all of them: the plan of one, its masks broadcast (`[1, 1, q, total]`), H_kv x B less work
    one = shared(pos, scores)
    rank_pos, rank_scores = (pos[:1, :1], scores[:1, :1]) if one else (pos, scores)
    # rank: best score first, the later token first among equals
    latest_first = rank_pos.argsort(dim=-1, descending=True, stable=True)
    ranked = torch.sort(rank_scores.gather(-1, latest_first), dim=-1, descending=True, stable=True).indices
    by_rank = latest_first.gather(-1, ranked)  # [B, H, total] slots, best first ([1, 1, total] shared)
    step_of = (torch.arange(total, device=pos.device) - n0).clamp(min=-1)  # chunk step of each slot, -1 held
    steps = torch.arange(q, device=pos.device)
    member = step_of[by_rank][:, :, None, :] <= steps[:, None]  # [B, H, q, total] in rank order
    within = member & (member.to(torch.int32).cumsum(dim=-1) <= budget)
    after = torch.zeros(*by_rank.shape[:2], q, total, dtype=torch.bool, device=pos.device)
    after.scatter_(-1, by_rank[:, :, None, :].expand(-1, -1, q, -1), within)  # kept after step i, by slot
    alive = torch.cat([(step_of < 0).expand(*by_rank.shape[:2], 1, total), after[:, :, :-1]], dim=2)
    alive[:, :, steps, n0 + steps] = True  # each query sees itself
    keep = rank_pos.masked_fill(~after[:, :, -1], selection.LATEST_LAST).argsort(dim=-1)[..., :budget]
    plan = StaticPlan(
        key=key,
        pos=pos.clone(),
        scores=scores,
        alive=alive.expand(b, hkv, q, total),
        after=after.expand(b, hkv, q, total),
        evicting=steps >= max(0, budget - n0),
        keep=keep.expand(b, hkv, budget),
        query_mask=alive if one else None,  # broadcast over every query head
    )
    layer.forward = replace(layer.forward, static_plan=plan)
    return plan


def shared(pos: torch.Tensor, scores: torch.Tensor) -> bool:
    """Whether every row and KV head holds the same positions in the same slots with the same scores
    (`[B, H, total]` each): then one (row, head)'s plan is every one's."""
    if pos.shape[0] * pos.shape[1] == 1:
        return False
    return bool((pos == pos[:1, :1]).all()) and bool((scores == scores[:1, :1]).all())


def replay_static(layer: ReplayingLayer, query: torch.Tensor, used: torch.Tensor, scaling: float) -> Replayed | None:
    """Closed-form replay for static scores. Returns the output `[B, H_q, q, D]` with the layer's new state,
    or None (nothing changed) when position-shift mode's shortcut does not apply.
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
    return Replayed(out, budget, True)


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


def replay_steps(layer: ReplayingLayer, query: torch.Tensor, used: torch.Tensor, scaling: float) -> Replayed:
    """The reference: step through the chunk's queries, attention, statistics and one eviction per step
    (`Stepper`), as the layer's position mode attends (`PositionMode.replay_steps`).

    query `[B, H_q, q, D]` as the model rotated it, at positions `used` `[q]`. Returns
    the output `[B, H_q, q, D]` with the layer's new state.
    """
    return layer.settings.mode.replay_steps(layer, query, used, scaling)


def steps_fixed_keys(layer: ReplayingLayer, query: torch.Tensor, used: torch.Tensor, scaling: float) -> Replayed:
    """Original positions: a stored key never changes, so a block of queries' logits over every slot
    they could see are computed once (`attention_stats.QueryRows`, a block within the layer's workspace),
    each step reads its alive slots from them, and the block's output is one masked softmax once its
    steps are done. A step that evicts moves the newest slot into the victim's place (as a decode step
    does)."""
    storage = layer.storage
    n0, q = layer.n, layer.new
    b, hq, _, d = query.shape
    hkv = layer.heads
    group = hq // hkv
    step = Stepper(layer, scaling)
    total_all = n0 + q
    keys, values = storage.keys[:, :, :total_all], storage.values[:, :, :total_all]
    rows = QueryRows(lambda start, stop: products(query[:, :, start:stop], keys), q, b * hq * total_all, scaling,
                     bound(layer.settings.workspace))
    outs, alive = [], None
    for i in range(q):
        slots, positions, seen = step.begin(i)
        logits = rows.row(i)  # [B, H_kv, g, n0 + q]
        if i == rows.start:  # [B, H_kv, block, n0 + q] what each query of the block sees
            alive = torch.zeros(b, hkv, rows.stop - rows.start, total_all, dtype=torch.bool, device=layer.device)
        alive[:, :, i - rows.start].scatter_(-1, slots, True)
        probs = None
        if step.wants_probs:
            logit = logits.gather(-1, slots[:, :, None, :].expand(-1, -1, group, -1))
            probs = softmax(logit, None)  # [B, H_kv, g, total]
        victim = step.end(slots, positions, seen, None, probs, query[:, :, i : i + 1], used[i : i + 1])
        if victim is not None:  # the newest slot (now just past the kept ones) fills the victim's place
            # the source copied: a slice of the tensor being written (refused by torch where it sees it)
            step.vslot.scatter_(-1, victim[..., None], step.vslot[:, :, step.k : step.k + 1].clone())
        if rows.ends_block(i):
            outs.append(rows.attend_block(alive, values))
    result = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    layer.settings.mode.compact(storage, step.vslot[:, :, : step.k], step.k)
    return Replayed(result, step.k, layer.ordered and not step.evicted)
