"""Ada-KV (`adakv:P`): the allocation, the cache's exactness and its real memory, each
against a computation written here (Python sorting, eager attention with a per-head mask)."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, DynamicCache

from kvevict import EvictingCache, KvevictError, parse_policy
from kvevict.cache.layers.per_head.allocation import allocate
from kvevict.eval.forward import body

from conftest import make_tiny, random_tokens
from support import attn


def reference_keep(alive: list[list[int]], score, total: int, floor: int) -> list[set[int]]:
    """Ada-KV by hand: each head its best `floor`, then the best of the rest over all heads.

    `alive[h]` the positions head h holds, `score(h, p)`. Ties: the later token, then the lower head.
    """
    keep = [set(sorted(a, key=lambda p, h=h: (score(h, p), p), reverse=True)[:floor]) for h, a in enumerate(alive)]
    pool = sorted(
        ((score(h, p), p, -h) for h, a in enumerate(alive) for p in a if p not in keep[h]), reverse=True
    )
    for _, p, minus_h in pool[: max(0, total - sum(len(k) for k in keep))]:
        keep[-minus_h].add(p)
    return keep


@pytest.mark.parametrize("seed", range(6))
def test_allocation_is_floor_then_joint_top_k(seed):
    g = torch.Generator().manual_seed(seed)
    b, h, width = 2, 3, 9
    lengths = torch.randint(0, width + 1, (b, h), generator=g)
    valid = torch.arange(width) < lengths[..., None]
    pos = torch.stack([torch.stack([torch.randperm(40, generator=g)[:width] for _ in range(h)]) for _ in range(b)])
    scores = torch.randint(0, 4, (b, h, width), generator=g).float()  # few values: many ties
    floor = torch.tensor([2, 0])
    total = 8
    keep = allocate(scores.masked_fill(~valid, float("-inf")), pos, valid, total, floor)
    for row in range(b):
        alive = [pos[row, head, : lengths[row, head]].tolist() for head in range(h)]
        where = {(head, int(pos[row, head, j])): float(scores[row, head, j]) for head in range(h) for j in range(width)}
        expected = reference_keep(alive, lambda hh, p, w=where: w[(hh, p)], total, int(floor[row]))
        got = [set(pos[row, head][keep[row, head]].tolist()) for head in range(h)]
        assert got == expected
        assert not bool((keep & ~valid).any())


@pytest.mark.parametrize("case", ["decode", "decode_at_floor", "prefill", "float64"])
def test_allocation_finds_the_few_worst_or_the_few_best_or_sorts_fine_scores(case):
    """Each way `allocate` can take against the same reference: a decode step drops one entry per
    head (it looks for the row's worst), unless those worst would take a head below its floor
    (head 0 scores worst and holds just its floor: the general way), a long prefill keeps few of
    many (it looks for the best), and float64 scores that float32 cannot tell apart go through
    stable sorts."""
    g = torch.Generator().manual_seed(7)
    b, h, total = 2, 3, 12
    held = total + h if case.startswith("decode") else 5 * total
    width = held  # one head may hold them all
    lengths = torch.stack([torch.multinomial(torch.ones(h), held, replacement=True, generator=g).bincount(
        minlength=h) for _ in range(b)])
    valid = torch.arange(width) < lengths[..., None]
    pos = torch.stack([torch.stack([torch.randperm(200, generator=g)[:width] for _ in range(h)]) for _ in range(b)])
    scores = torch.randint(0, 5, (b, h, width), generator=g).double()
    if case == "float64":
        scores = 1.0 + scores * 1e-12  # all equal in float32
    else:
        scores = scores.float()
    floor = torch.tensor([1, 0])
    if case == "decode_at_floor":
        scores[:, 0] -= 10.0
        floor = lengths[:, 0].clamp(min=1)
    keep = allocate(scores.masked_fill(~valid, float("-inf")), pos, valid, total, floor)
    for row in range(b):
        alive = [pos[row, head, : lengths[row, head]].tolist() for head in range(h)]
        where = {(head, int(pos[row, head, j])): float(scores[row, head, j]) for head in range(h) for j in range(width)}
        expected = reference_keep(alive, lambda hh, p, w=where: w[(hh, p)], total, int(floor[row]))
        assert [set(pos[row, head][keep[row, head]].tolist()) for head in range(h)] == expected


@pytest.mark.parametrize("case", ["decode", "decode_at_floor"])
@pytest.mark.parametrize("seed", range(4))
def test_allocation_over_slots_each_owned_by_one_head(case, seed):
    """The ragged layer's layout: each slot of a row belongs to one head (`owner`), the others see it as
    a pad. Told so, a decode step ranks the slots once each; the kept sets are the reference's (ties on
    few score values, holes inside segments, a head at its floor sending the step the general way)."""
    g = torch.Generator().manual_seed(seed)
    b, h, segment, total = 2, 3, 7, 15
    owner = (torch.arange(h * segment) // segment).expand(b, -1)  # [B, L]
    own = owner[:, None, :] == torch.arange(h)[None, :, None]  # [B, H, L]
    held = torch.rand(b, h * segment, generator=g) < 0.9
    for row in range(b):  # make each row hold total + 1..h entries
        want = int(torch.randint(1, h + 1, (), generator=g))
        free = (~held[row]).nonzero()[:, 0]
        while int(held[row].sum()) < total + want and free.numel():
            held[row, free[0]], free = True, free[1:]
        while int(held[row].sum()) > total + want:
            held[row, held[row].nonzero()[0, 0]] = False
    valid = own & held[:, None, :]
    pos = torch.stack([torch.randperm(100, generator=g)[: h * segment] for _ in range(b)])
    scores = torch.randint(0, 3, (b, h, h * segment), generator=g).float()
    floor = torch.tensor([1, 2])
    if case == "decode_at_floor":  # head 0 scores worst and holds exactly its floor
        scores[:, 0] -= 10.0
        floor = valid[:, 0].sum(dim=-1).clamp(min=1)
    positions = pos[:, None, :].expand(-1, h, -1).masked_fill(~valid, -1)
    scores = scores.masked_fill(~valid, float("-inf"))
    keep = allocate(scores, positions, valid, total, floor, owner)
    assert torch.equal(keep, allocate(scores, positions, valid, total, floor))
    for row in range(b):
        alive = [pos[row][valid[row, head]].tolist() for head in range(h)]
        where = {(head, int(pos[row, j])): float(scores[row, head, j]) for head in range(h)
                 for j in range(h * segment) if valid[row, head, j]}
        expected = reference_keep(alive, lambda hh, p, w=where: w[(hh, p)], total, int(floor[row]))
        assert [set(pos[row][keep[row, head]].tolist()) for head in range(h)] == expected


def test_a_head_whose_scores_are_low_keeps_its_floor_and_the_rest_goes_to_the_others():
    scores = torch.tensor([[[9.0, 8, 7, 6], [1, 1, 1, 1]]])
    pos = torch.tensor([[[0, 1, 2, 3], [0, 1, 2, 3]]])
    valid = torch.ones(1, 2, 4, dtype=torch.bool)
    keep = allocate(scores, pos, valid, 4, torch.tensor([1]))
    assert keep.sum(-1).tolist() == [[3, 1]]
    assert keep[0, 1].tolist() == [False, False, False, True]  # the later token among equals


# --- the cache against eager attention with a per-(layer, KV head) mask and Ada-KV by hand ---


class AdaH2OReference:
    """Full cache + eager attention + an evicted mask per (layer, KV head); Ada-KV over H2O by hand.

    Per head: recent tokens and pinned sinks score +inf, the others their attention summed
    over every query so far (and the query heads of the group). The layer keeps `H x budget`.
    """

    def __init__(self, budget: int, recent_share: float, sinks: int, alpha: float) -> None:
        self.budget, self.sinks = budget, sinks
        self.recent = int(round(recent_share * (budget - sinks)))
        self.floor = sinks + int(alpha * (budget - sinks) + 1e-9)
        self.acc: dict[int, torch.Tensor] = {}
        self.evicted: dict[int, torch.Tensor] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        layer = module.layer_idx
        b, hq, q, d = query.shape
        hkv, total = key.shape[1], key.shape[2]
        group = hq // hkv
        acc = torch.cat([self.acc.get(layer, torch.zeros(b, hkv, 0)), torch.zeros(b, hkv, q)], dim=2)
        before = self.evicted.get(layer, torch.zeros(b, hkv, 0, dtype=torch.bool))
        evicted = torch.cat([before, torch.zeros(b, hkv, q, dtype=torch.bool)], dim=2)
        k = key.repeat_interleave(group, dim=1)
        v = value.repeat_interleave(group, dim=1)
        logits = (query @ k.transpose(-1, -2)).float() * scaling
        allowed = torch.arange(total)[None, :] <= torch.arange(total - q, total)[:, None]
        allowed = allowed[None, None] & ~evicted.repeat_interleave(group, dim=1)[:, :, None, :]
        probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
        out = probs.to(value.dtype) @ v
        acc += probs.view(b, hkv, group, q, total).sum(dim=(2, 3))
        for row in range(b):
            alive = [(~evicted[row, head]).nonzero()[:, 0].tolist() for head in range(hkv)]
            if sum(len(a) for a in alive) <= hkv * self.budget:
                continue

            def score(head, p, row=row):
                protected = p < self.sinks or p >= total - self.recent
                return float("inf") if protected else float(acc[row, head, p])

            keep = reference_keep(alive, score, hkv * self.budget, self.floor)
            for head in range(hkv):
                for p in alive[head]:
                    evicted[row, head, p] = p not in keep[head]
        self.acc[layer], self.evicted[layer] = acc, evicted
        return out.transpose(1, 2).contiguous(), probs


def run_against_reference(budget: int, recent: float, sinks: int, alpha: float, prefill: int, tokens: int = 90):
    """Our logits and kept positions against `AdaH2OReference`'s, prefill of `prefill` tokens then decode."""
    model = make_tiny(seed=12)
    tokens = random_tokens(tokens, seed=budget)
    spec = f"adakv:alpha={alpha}:h2o:recent={recent}"
    spec = spec if sinks == 0 else f"sink{sinks}+{spec}"
    chunks = [tokens[:prefill]] + [tokens[t : t + 1] for t in range(prefill, tokens.numel())]
    cache = EvictingCache(model, spec, budget=budget)
    ours = []
    with torch.inference_mode():
        for chunk in chunks:
            ours.append(model.get_output_embeddings()(body(model, chunk[None], cache))[0])
    reference = AdaH2OReference(budget, recent, sinks, alpha)
    AttentionInterface.register("adakv_reference", reference)
    theirs = []
    with attn(model, "adakv_reference"), torch.inference_mode():
        full = DynamicCache(config=model.config)
        for chunk in chunks:
            theirs.append(model(chunk[None], past_key_values=full, use_cache=True).logits[0])
    assert torch.allclose(torch.cat(ours), torch.cat(theirs), atol=1e-4, rtol=1e-4)
    unequal = False
    for index, layer in enumerate(cache.layers):
        kept = layer.kept_positions()[0]
        for head in range(kept.shape[0]):
            expected = (~reference.evicted[index][0, head]).nonzero()[:, 0].tolist()
            assert kept[head][kept[head] >= 0].tolist() == expected, f"layer {index} head {head}"
            unequal |= len(expected) != budget
    assert unequal, "every head kept exactly the budget: the test does not exercise head-wise budgets"


@pytest.mark.parametrize("budget,recent,sinks,alpha", [(12, 0.25, 0, 0.2), (14, 0.5, 2, 0.0), (16, 0.25, 2, 0.2)])
def test_adakv_h2o_matches_masked_reference(budget, recent, sinks, alpha):
    run_against_reference(budget, recent, sinks, alpha, prefill=budget)


def test_a_long_prefill_attends_in_blocks_of_queries_and_matches_the_reference(monkeypatch):
    """A prefill bigger than `BLOCK_ELEMENTS` logits goes through the layer's attention a few
    queries at a time (here 3: the bound shrunk so a tiny model reaches it); every block's causal
    mask and its share of H2O's attention must add up to the reference's one pass."""
    import kvevict.cache.layers.per_head.layer as ragged

    heads, width = 4, 2 * (16 + 16)  # query heads, one row's buffer: KV heads x (budget + slack)
    monkeypatch.setattr(ragged, "BLOCK_ELEMENTS", 3 * heads * width)
    run_against_reference(16, 0.25, 0, 0.2, prefill=30, tokens=60)


def snapkv_by_hand(attentions: torch.Tensor, heads: int, window: int, kernel: int) -> torch.Tensor:
    """SnapKV's scores after a prefill, from eager attention weights `[H_q, T, T]` of one layer:
    per KV head, the attention the last `window` queries of its query group pay to each earlier
    token, max-pooled `kernel` wide along the positions (the pooling's window cut at both ends),
    the window itself `inf`. Returns `[H_kv, T]`."""
    hq, total, _ = attentions.shape
    mass = attentions[:, total - window :].sum(dim=1).view(heads, hq // heads, total).sum(dim=1)
    prefix = total - window
    scores = torch.full((heads, total), float("inf"))
    for head in range(heads):
        for p in range(prefix):
            lo, hi = max(0, p - kernel // 2), min(prefix, p + kernel // 2 + 1)
            scores[head, p] = mass[head, lo:hi].max()
    return scores


@pytest.mark.parametrize("alpha,budget", [(0.2, 16), (0.0, 12), (1.0, 16)])
def test_adakv_snapkv_compression_matches_snapkv_by_hand(alpha, budget):
    """What RULER's rows compress with (`adakv:snapkv`): after one prefill each layer keeps, per
    row, the `H x budget` entries Ada-KV picks from SnapKV's pooled window scores, read here
    from eager attention weights; `alpha=1` is plain SnapKV's per-head top-`budget`."""
    from kvevict.eval.compress import compress

    model = make_tiny(seed=21, kv_heads=2)
    tokens = random_tokens(70, seed=22)
    window, kernel = 4, 7
    heads = model.config.num_key_value_heads
    state = compress(model, tokens, f"adakv:alpha={alpha}:snapkv:window={window},kernel={kernel}", budget)
    with attn(model, "eager"), torch.inference_mode():
        attentions = model(tokens[None], output_attentions=True).attentions
    floor = int(alpha * budget + 1e-9)
    uneven = False
    for index, layer in enumerate(state.cache.layers):
        scores = snapkv_by_hand(attentions[index][0].float(), heads, window, kernel)
        alive = [list(range(tokens.numel()))] * heads
        expected = reference_keep(alive, lambda h, p, s=scores: float(s[h, p]), heads * budget, floor)
        kept = layer.kept_positions()[0]
        for head in range(heads):
            assert kept[head][kept[head] >= 0].tolist() == sorted(expected[head]), f"layer {index} head {head}"
            uneven |= len(expected[head]) != budget
    assert uneven == (alpha < 1), "the heads split as the allocation says they may"


# --- real memory ------------------------------------------------------------------------


def test_storage_holds_the_layer_allowance_not_the_longest_head_times_heads():
    model = make_tiny(seed=5)
    tokens = random_tokens(80, seed=6)
    budget, slack = 10, 4
    cache = EvictingCache(model, ["adakv:knorm"] * 2, budget=budget, slack=slack, per_token=True)
    with torch.inference_mode():
        for start in range(0, 80, 16):
            body(model, tokens[None, start : start + 16].expand(2, -1), cache)
    memory = cache.memory()
    unbalanced = False
    for layer, lengths in zip(cache.layers, memory.per_head):
        lengths = torch.tensor(lengths)  # [B, H]
        rows, heads = lengths.shape
        assert lengths.sum(-1).tolist() == [heads * budget] * rows
        allocated = layer.storage.kv.numel() // (2 * layer.head_dim)  # entries the buffers hold room for
        assert allocated <= rows * heads * (budget + slack)
        padded = rows * heads * (int(lengths.max()) + slack)  # every head padded to the longest
        unbalanced |= int(lengths.max()) > budget
        if int(lengths.max()) > budget:
            assert allocated < padded
    assert unbalanced, "the heads stayed balanced: the test shows nothing about padding"
    entry = 2 * model.config.head_dim * 4  # a float32 key and value
    assert memory.kv_bytes == entry * sum(torch.tensor(p).sum().item() for p in memory.per_head)
    assert memory.allocated_kv_bytes == sum(layer.storage.kv.numel() * 4 for layer in cache.layers)


def test_streaming_records_say_what_each_head_holds():
    """What a user reads: the row's JSON (`kvevict ppl --json`, `kvevict ab`'s records) lists the
    entries each KV head of each layer holds; they fill the allowance and the bytes add up."""
    from kvevict import compare

    model = make_tiny(seed=5)
    rows, _ = compare(model, random_tokens(80, seed=6), ["adakv:knorm"], 10, reference=False, progress=False)
    data = rows[0].summary()
    heads = model.config.num_key_value_heads
    held = data["held_per_head"]
    assert len(held) == model.config.num_hidden_layers and all(len(layer) == heads for layer in held)
    assert all(sum(layer) == heads * 10 for layer in held)
    assert data["kv_bytes"] == 2 * model.config.head_dim * 4 * sum(map(sum, held))


def test_allocated_bytes_stay_bounded_over_a_long_decode():
    """Evictions leave holes that the next re-pack gives back: over hundreds of decode steps the
    buffers stay at `KV heads x (budget + slack)` entries a row, and what is held is the allowance."""
    model = make_tiny(seed=3)
    budget, slack, steps = 12, 4, 400
    tokens = random_tokens(budget + steps, seed=4)
    cache = EvictingCache(model, "adakv:h2o", budget=budget, slack=slack)
    config = model.config
    entry = 2 * config.head_dim * 4  # a float32 key and its value
    bound = config.num_hidden_layers * config.num_key_value_heads * (budget + slack) * entry
    allocated = []
    gone_at = torch.full((config.num_hidden_layers, config.num_key_value_heads), -1)  # tokens seen when 0 left
    with torch.inference_mode():
        body(model, tokens[None, :budget], cache)
        for t in range(budget, tokens.numel()):
            body(model, tokens[None, t : t + 1], cache)
            memory = cache.memory()
            allocated.append(memory.allocated_kv_bytes)
            held = torch.stack([(layer.kept_positions()[0] == 0).any(dim=-1) for layer in cache.layers])
            gone_at = torch.where(~held & (gone_at < 0), t + 1, gone_at)
            assert memory.kv_bytes == config.num_hidden_layers * config.num_key_value_heads * budget * entry
    assert max(allocated) <= bound, f"allocated {max(allocated)} bytes, bound {bound}"
    # what the layers told the sink tracker: token 0 left a (layer, head) at the first step it was not held
    assert torch.equal(cache.sink_lost_at()[:, 0], gone_at)
    assert any(max(max(row) for row in p) > budget for p in memory.per_head)  # the heads did split unevenly


# --- prefill compression ----------------------------------------------------------------


def test_prompt_compression_with_head_budgets():
    """`eval/compress.py` with adakv: alpha=1 is the uniform policy (floor = budget), so its
    continuation scores equal plain h2o's, which tests/test_compress.py checks against eager
    attention; alpha=0.2 compresses to the layer's allowance, split unevenly, and scores differently."""
    from kvevict.eval.compress import compress, continuation_nll

    model = make_tiny(seed=8)
    tokens = random_tokens(100, seed=9)
    budget = 24
    uniform = [continuation_nll(model, tokens[:80], tokens[80:], spec, budget)[0]
               for spec in ("h2o", "adakv:alpha=1:h2o")]  # separate caches: adakv's layers are ragged
    torch.testing.assert_close(uniform[1], uniform[0], rtol=1e-5, atol=1e-5)
    state = compress(model, tokens[:80], "adakv:h2o", budget)
    memory = state.cache.memory()
    heads = model.config.num_key_value_heads
    assert all(torch.tensor(p).sum().item() == heads * budget for p in memory.per_head)
    assert any(max(max(row) for row in p) > budget for p in memory.per_head)  # the heads did not split evenly
    adaptive = continuation_nll(model, tokens[:80], tokens[80:], "adakv:h2o", budget)[0]
    assert (adaptive - uniform[0]).abs().max() > 1e-3


# --- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec,budget,needle",
    [
        ("adakv", 16, "names no policy"),
        ("adakv:alpha=0.3", 16, "names no policy"),
        ("adakv:full", 16, "scores entries"),
        ("adakv:random", 16, "scores entries"),
        ("adakv:alpha=1.5:h2o", 16, "[0, 1]"),
        ("adakv:alpha=-0.1:h2o", 16, "[0, 1]"),
        ("adakv:adakv:h2o", 16, "nests adakv"),
        ("adakv:sink4+h2o", 16, "sink4+adakv:h2o"),
        ("adakv:alpha=0.2:h2o", 4, "at least 5"),
        ("adakv:snapkv:window=8", 8, "smaller than the budget"),
    ],
)
def test_bad_adakv_specs_are_refused(spec, budget, needle):
    from kvevict.policies import check_policy

    with pytest.raises(KvevictError) as caught:
        check_policy(spec, budget, "original")
    assert needle in str(caught.value)


def test_cache_positions_are_refused():
    with pytest.raises(KvevictError, match="positions='original'"):
        EvictingCache(make_tiny(), "adakv:h2o", budget=16, positions="cache")


def test_spec_round_trips():
    policy = parse_policy("sink4+adakv:alpha=0.1:snapkv:window=16")
    assert policy.spec() == "sink4+adakv:alpha=0.1:snapkv:window=16,kernel=7,pooling=max,interval=16"
    assert parse_policy(policy.spec()).spec() == policy.spec()
    assert policy.head_floor(104) == 4 + 10 and policy.own_batch
