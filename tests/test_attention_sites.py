"""Every place the engine computes attention by hand, run through the attention-statistics kernel in blocks
of queries, against eager attention written in the tests.

The reference is the architecture matrix's (`test_architectures.Reference`): the model's own forward over a
full `DynamicCache`, its attention replaced by a plain softmax over masked scores where each query sees
exactly the keys the policy would have kept, H2O's kept set recomputed step by step from the reference's own
probabilities, and in position-shift mode every visible key and the query re-rotated to their rank. Each
site below is one stream that reaches it (a spy checks that it ran), under two bounds: the default (64 MiB:
at these sizes one block) and a workspace of 2 KiB, which forces blocks of a few queries; its observer must
never see a block above it.

What must hold, per site: the NLL within 1e-4 relative of the reference (float32 against the reference's
own float32 arithmetic, as the matrix asks), the kept sets equal to the reference's, and, between the two
bounds, the same kept sets and the NLL within 2e-5 (the blocks' sums reorder float32 additions, and the BLAS
may give a smaller block's products other last bits; measured at most 1.2e-5 at head_dim 16).

Three sites are not streams: KVzip's reconstruction window (`per_head/reconstruction.window_mass`) and
Expected Attention's expected query (`ExpectedAttention.absorb`) are checked against their formulas
computed here in float64, and a long prefill shows the bound honoured where the whole matrix would be 64
times it.
"""

from __future__ import annotations

import pytest
import torch

import kvevict.cache.layers.per_head.layer as ragged
import kvevict.cache.layers.slots as slot_layer
import kvevict.cache.positions.modes as positions
import kvevict.cache.replay.by_slot as by_slot
import kvevict.cache.replay.chunk as replay
import kvevict.cache.statistics.measure as statistics
from architectures import ARCHS
from kvevict import EvictingCache
from kvevict.attention_stats import Workspace
from kvevict.cache.layers.per_head.reconstruction import window_mass
from kvevict.errors import KvevictError
from kvevict.policies import QueryBatch
from kvevict.policies.expected_attention import ExpectedAttention
from test_architectures import BUDGET, CACHE_KWARG, TOKENS, Reference

from support import nll_from_logits, reference_nll_with

SMALL = 2048  # bytes of logits per block: a few queries of these streams
LLAMA = next(a for a in ARCHS if a.name == "llama3")  # grouped-query: 4 query heads over 2 KV heads


def spy(monkeypatch, owner, name: str) -> list[int]:
    """Count the calls of `owner.name` from now on (the site a stream must reach)."""
    calls: list[int] = []
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def stream(model, specs: list[str], mode: str, prefill: int, chunk: int, per_token: bool, workspace):
    """NLL `[rows, T-1]` and kept positions (per layer `[rows, H_kv, n]`) of `TOKENS`: `prefill` tokens in one
    forward, then `chunk` at a time."""
    cache = EvictingCache(model, specs, budget=BUDGET, positions=mode, per_token=per_token, workspace=workspace)
    starts = [0, *range(prefill, TOKENS.numel(), chunk)]
    logits = []
    with torch.inference_mode():
        for start, stop in zip(starts, [*starts[1:], TOKENS.numel()]):
            ids = TOKENS[None, start:stop].expand(len(specs), -1)
            logits.append(model(ids, use_cache=True, **{CACHE_KWARG(model): cache}).logits)
    logits = torch.cat(logits, dim=1)
    return torch.stack([nll_from_logits(row, TOKENS) for row in logits]), cache.kept_positions()


def reference(model, rule, mode: str, prefill: int):
    """The reference's NLL `[T-1]` and, per layer, the positions each KV head keeps `[H_kv, n]` (H2O's rule:
    recomputed from its own attention; a band: the sinks and the latest)."""
    made: list[Reference] = []

    class Recorded(Reference):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    nll = reference_nll_with(Recorded, model, rule, mode == "cache", prefill=prefill)
    total = TOKENS.numel()
    if rule[0] == "band":
        sinks = int(rule[1])
        kept = torch.cat([torch.arange(sinks), torch.arange(total - (BUDGET - sinks), total)])
        return nll, [kept.expand(model.config.num_key_value_heads, -1)] * model.config.num_hidden_layers
    return nll, [torch.stack([(~row).nonzero()[:, 0] for row in made[0].evicted[layer][0]])
                 for layer in sorted(made[0].evicted)]


#: site -> (what it spies on, specs (row 0 is checked), position mode, prefill, chunk, per_token, reference rule)
SITES = {
    # a prefill's sums over all its queries (`statistics` -> `probabilities.attention_mass` -> `column_sums`),
    # then decode steps attending by hand with their probabilities (`slot_layer.attend` -> `query_attention`)
    "prefill sums, decode": ((statistics, "attention_mass"), ["h2o:recent=0.5"], "original", 40, 1, False),
    "prefill sums, decode, shifted": ((slot_layer, "query_attention"), ["h2o:recent=0.5"], "cache", 40, 1, False),
    # a decode step beside a row that asks nothing: SDPA attends, the statistics measure it (`query_probs`)
    "decode beside another row": ((statistics, "query_probs"), ["h2o:recent=0.5", "knorm"], "original", 12, 1,
                                  False),
    # chunks replayed token by token: by slot (`_Chunk.new_mass` over `QueryRows`), the reference stepping
    # (`replay.steps_fixed_keys`, a random row beside takes the chunk off the by-slot path), the position
    # shift's stepping (`query_attention` with each step's keys re-rotated) and closed form (`attend`)
    "by slot": ((by_slot._Chunk, "new_mass"), ["h2o:recent=0.5"], "original", BUDGET, 7, True),
    "reference stepping": ((replay, "steps_fixed_keys"), ["h2o:recent=0.5", "random"], "original", BUDGET, 7, True),
    "shifted stepping": ((positions.ShiftedPositions, "replay_steps"), ["h2o:recent=0.5"], "cache", BUDGET, 7,
                         True),
    "shifted closed form": ((positions.ShiftedPositions, "static_attention"), ["sink4+window"], "cache", BUDGET, 7,
                            True),
    # the per-head layer (`ragged_attention` -> `attend` with every head's own entries): a long prefill, then
    # decode steps; at alpha=1 Ada-KV keeps what H2O keeps
    "per-head layer": ((ragged, "ragged_attention"), ["adakv:alpha=1:h2o:recent=0.5"], "original", 40, 1, False),
    "per-head layer, chunks": ((ragged, "ragged_attention"), ["adakv:alpha=1:h2o:recent=0.5"], "original", BUDGET,
                               7, True),
}


@pytest.mark.parametrize("site", list(SITES))
def test_each_site_in_blocks_keeps_what_eager_attention_keeps(site, monkeypatch):
    (owner, name), specs, mode, prefill, chunk, per_token = SITES[site]
    rule = ("band", 4) if specs[0] == "sink4+window" else ("h2o", 0.5)
    model = LLAMA.build(seed=3)
    ref_nll, ref_kept = reference(model, rule, mode, prefill)
    calls = spy(monkeypatch, owner, name)
    seen: list[int] = []
    whole_nll, whole_kept = stream(model, specs, mode, prefill, chunk, per_token, None)
    nll, kept = stream(model, specs, mode, prefill, chunk, per_token, Workspace(SMALL, seen.append))
    assert calls, f"{site}: the stream never reached {name}"
    err = ((nll[0] - ref_nll).abs() / ref_nll.abs().clamp(min=1.0)).max()
    assert err < 1e-4, f"{site}: NLL {err:.2e} from eager attention"
    for layer, (ours, theirs) in enumerate(zip(kept, ref_kept)):
        assert torch.equal(ours[0], theirs), f"{site}: layer {layer} kept another set than eager attention"
    assert all(torch.equal(a, b) for a, b in zip(kept, whole_kept)), f"{site}: the bound changed a kept set"
    torch.testing.assert_close(nll, whole_nll, rtol=0, atol=2e-5)
    assert seen and max(seen) <= SMALL  # blocks were made, none above the bound


def test_a_long_prefill_holds_one_block_of_logits_within_the_bound():
    """512 tokens in one forward: H2O's sums over every query would be 512 x 512 logits per query head (4 MiB at
    4 query heads), 64 times the 64 KiB workspace; every block stays within it, and the statistics are the
    default bound's (the kept sets equal)."""
    model = LLAMA.build(seed=3)
    ids = torch.randint(0, 101, (1, 512), generator=torch.Generator().manual_seed(9))
    bound, kept = 64 << 10, {}
    assert 4 * 512 * 512 * 4 == 64 * bound
    for spec in ("h2o", "adakv:h2o"):
        for workspace in (None, bound):
            seen: list[int] = []
            cache = EvictingCache(model, spec, budget=64,
                                  workspace=None if workspace is None else Workspace(workspace, seen.append))
            with torch.inference_mode():
                model(ids, use_cache=True, **{CACHE_KWARG(model): cache})
            kept[spec, workspace] = cache.kept_positions()
            if workspace is not None:
                assert len(seen) >= 64 and max(seen) <= bound, spec
        assert all(torch.equal(a, b) for a, b in zip(kept[spec, None], kept[spec, bound])), spec


def test_kvzip_window_mass_is_the_largest_windowed_probability():
    """`window_mass` against its definition: per KV head, each query of the repeat forward soft-maxed over its
    head's entries in the window (before the sinks' end, in the repeated chunk, the forward's own tokens up to
    itself), the largest probability any query of the group gave each chunk entry, NaN outside the chunk."""
    g = torch.Generator().manual_seed(11)
    b, heads, group, d, capacity, m, first = 1, 2, 2, 8, 40, 6, 30
    query = torch.randn(b, heads * group, m, d, generator=g)
    keys = torch.randn(b, capacity, d, generator=g)
    key_pos = torch.randperm(capacity, generator=g)[None]  # positions 0..39 in any slot order
    members = torch.rand(b, heads, capacity, generator=g) < 0.7
    members[:, :, key_pos[0] >= first] = True  # the forward's own tokens are every head's
    chunk, sinks = (10, 20), 2
    for rows in (1, 2, m):
        seen: list[int] = []
        bound = rows * heads * group * capacity * 4
        got = window_mass(query, keys, key_pos, members, first, chunk, sinks, 0.4, Workspace(bound, seen.append))
        assert max(seen) <= bound
        for head in range(heads):
            pos = key_pos[0]
            window = members[0, head] & ((pos < sinks) | ((pos >= 10) & (pos < 20)) | (pos >= first))
            scores = query[0, head * group : (head + 1) * group].double() @ keys[0].double().T * 0.4  # [g, m, cap]
            visible = window & (pos[None, :] <= torch.arange(first, first + m)[:, None])  # [m, capacity]
            probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
            best = probs.amax(dim=(0, 1))
            scored = window & (pos >= 10) & (pos < 20)
            torch.testing.assert_close(got[0, head][scored], best[scored].float(), atol=1e-6, rtol=1e-5)
            assert got[0, head][~scored].isnan().all()


class _View:
    """What `ExpectedAttention.absorb` reads of a `SlotView`: positions, keys, values, the policy's state, and
    that the forward is no chunk of a held-back context."""

    held_back = False

    def __init__(self, positions, keys, values, state) -> None:
        self.positions, self._keys, self._values, self.state = positions, keys, values, state

    def keys(self):
        return self._keys

    def values(self):
        return self._values


@pytest.mark.parametrize("head_dim", [16, 24])
def test_expected_attention_is_the_expected_querys_softmax(head_dim):
    """The score against its definition in float64 (module docstring of `expected_attention.py`): per query head,
    the mean query after the sinks and its covariance, turned by the rotation averaged over the next positions;
    each held entry's logit `k.mu' / sqrt(D) + k^T S' k / (2D)`, soft-maxed over the entries after the sinks,
    averaged over the group, times the value's norm. head_dim 16 scales by 1/4 exactly; 24 by a rounded
    1/sqrt(24) (the kernel multiplies where kvpress divides: one rounding per logit)."""
    g = torch.Generator().manual_seed(13)
    b, hq, hkv, m, n, d = 1, 4, 2, 12, 20, head_dim
    policy = ExpectedAttention(n_future_positions=8, n_sink=2)
    raw = torch.randn(b, hq, m, d, generator=g)
    stream = torch.arange(m)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).double() / d))

    def rotation(pos):
        angles = pos.double()[:, None] * inv[None]
        return torch.cat([angles.cos()] * 2, -1).float(), torch.cat([angles.sin()] * 2, -1).float()

    batch = QueryBatch(raw, stream, rotation, m)
    keys, values = torch.randn(b, hkv, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g)
    positions = torch.randperm(n, generator=g).expand(b, hkv, n)
    view = _View(positions, keys, values, policy.new_state(0))
    got = policy.absorb(view, policy.request(view, will_evict=True), batch)
    kept = raw[:, :, 2:].double()  # after the sinks
    mu = kept.mean(dim=2)
    centred = kept - mu[:, :, None]
    cov = centred.transpose(-1, -2) @ centred / kept.shape[2]
    future = torch.arange(m, m + 8).double()[:, None] * inv[None]
    cos, sin = torch.cat([future.cos()] * 2, -1).mean(0), torch.cat([future.sin()] * 2, -1).mean(0)
    eye = torch.eye(d, dtype=torch.float64)
    half = d // 2
    turn = eye * cos + torch.cat((-eye[:, half:], eye[:, :half]), dim=-1) * sin  # x @ turn: x rotated on average
    mu, cov = mu @ turn, turn.T @ cov @ turn
    k = keys.double().repeat_interleave(hq // hkv, dim=1)
    logits = (mu[:, :, None] @ k.transpose(-1, -2))[:, :, 0] / d**0.5
    logits = logits + torch.einsum("bhnd,bhde,bhne->bhn", k, cov, k) / d / 2
    judged = positions.repeat_interleave(hq // hkv, dim=1) >= 2
    probs = torch.softmax(logits.masked_fill(~judged, float("-inf")), dim=-1).view(b, hkv, hq // hkv, n).mean(2)
    want = (probs * values.double().norm(dim=-1)).masked_fill(positions < 2, 0.0)
    torch.testing.assert_close(got, want.float(), atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("workspace,needle", [(0, "workspace=0 bytes bounds nothing"),
                                              ("64MiB", "workspace='64MiB' is not a size")])
def test_a_bad_workspace_is_refused_in_one_line(workspace, needle):
    model = LLAMA.build(seed=3)
    with pytest.raises(KvevictError, match=needle) as caught:
        EvictingCache(model, "h2o", budget=8, workspace=workspace)
    assert "\n" not in str(caught.value)
