"""Rows that are done leave a batch frozen for good, and the rows that stay compute what they did.

A batch of answers decodes as long as its longest answer; `EvictingCache.batch_select_indices` lets the
finished rows go once the cache is frozen for good (`freeze(final=True)`: it never evicts
again, so its policies stop measuring). The reference for every row that stays is its
policy compressed in a cache of its own, fed the same tokens: the next logits, the entries
held and where token 0 left must be that row's. Uniform layers, per-head (ragged) layers and
Gemma 3's sliding layers, in both position modes where the policy runs in both.
"""

from __future__ import annotations

import pytest
import torch

from kvevict.errors import KvevictError
from kvevict.eval.compress import Compressed, compress, greedy

from conftest import make_tiny, random_tokens
from policy_matrix import position_modes

UNIFORM = ["window", "h2o:recent=0.25", "snapkv:window=2,interval=3", "tova", "sink4+h2o:recent=0.25"]
RAGGED = ["adakv:snapkv:window=2,interval=3", "adakv:h2o:recent=0.25", "adakv:tova"]
T, BUDGET = 60, 20


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request, tiny):
    if request.param == "llama":
        return tiny
    from architectures import Arch

    return Arch("gemma3", ("original",)).build().eval()


def _frozen(model, specs: list[str], positions: str) -> Compressed:
    state = compress(model, random_tokens(T, seed=3), specs, BUDGET, positions)
    state.cache.freeze(final=True)
    return state


@pytest.mark.parametrize("specs", [UNIFORM, RAGGED], ids=["uniform", "per-head"])
def test_the_rows_that_stay_compute_what_their_policy_computes_alone(model, specs):
    steps = random_tokens(20, seed=5)  # past the slack: a ragged row re-packs its segments after rows left
    stay = [4, 0] if len(specs) > 3 else [2, 0]  # out of order; sink4+h2o keeps token 0, window loses it
    # a batch's width changes how the matrix products are blocked (and a ragged layer's buffers are as
    # wide as the batch's fullest row needs): a row alone differs in the last bits from the same row in a
    # batch, before any row leaves as after, ~2e-5 here; a wrong row or entry differs by whole units
    tol = 1e-4
    for positions in position_modes(specs[0]):
        with torch.inference_mode():
            state = _frozen(model, specs, positions)
            alone = [_frozen(model, [specs[r]], positions) for r in stay]
            for i, token in enumerate(steps):
                if i == 2:
                    names = state.policies
                    state.keep_rows(stay)
                    assert state.rows == len(stay) and state.policies == [names[r] for r in stay]
                    assert [p.spec() for p in state.cache.row_policies()] == [names[r] for r in stay]
                got = state.next_logits(model)
                for k, ref in enumerate(alone):
                    row = k if i >= 2 else stay[k]
                    torch.testing.assert_close(got[row], ref.next_logits(model)[0], rtol=tol, atol=tol)
                state.feed(model, token[None])
                for ref in alone:
                    ref.feed(model, token[None])
            for layer, ref_layers in zip(state.cache.kept_positions(), zip(*[r.cache.kept_positions() for r in alone])):
                for k, ref in enumerate(ref_layers):  # per head: its held positions (a ragged layer pads with -1)
                    assert [h[h >= 0].tolist() for h in layer[k]] == [h[h >= 0].tolist() for h in ref[0]], \
                        (specs[stay[k]], positions)
            lost = state.cache.sink_lost_at()
            for k, ref in enumerate(alone):
                assert torch.equal(lost[:, k], ref.cache.sink_lost_at()[:, 0]), (specs[stay[k]], positions)


def test_a_cache_frozen_for_good_measures_nothing_and_refuses_a_budget(tiny):
    with torch.inference_mode():
        state = _frozen(tiny, ["h2o:recent=0.25", "tova"], "original")
        before = {i: {name: s.clone() for name, s in layer.storage.stats.items()}
                  for i, layer in enumerate(state.cache.layers)}
        state.feed(tiny, random_tokens(4, seed=8))
        for i, layer in enumerate(state.cache.layers):
            for name, stat in layer.storage.stats.items():
                # what was held keeps its statistic; the new entries' stays as they arrived (zero)
                assert torch.equal(stat[..., :BUDGET], before[i][name][..., :BUDGET]), name
                assert not stat[..., BUDGET : BUDGET + 4].any(), name
        with pytest.raises(KvevictError, match="frozen for good"):
            state.cache.budget = BUDGET


def test_rows_leave_only_a_cache_frozen_for_good(tiny):
    with torch.inference_mode():
        state = compress(tiny, random_tokens(T, seed=3), UNIFORM[:2], BUDGET)  # frozen, not for good
        with pytest.raises(KvevictError, match="frozen for good"):
            state.keep_rows([1])
        state.cache.freeze(final=True)
        for rows in ([], [0, 0], [2]):
            with pytest.raises(KvevictError, match="distinct rows of the 2"):
                state.cache.batch_select_indices(rows)


def test_greedy_lets_finished_rows_go_and_answers_alike():
    model = make_tiny(seed=4)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # wide margins between the best two tokens: no argmax sits on a tie
    lengths = [3, 9, 1, 5, 2]  # row r is done after lengths[r] tokens

    def finished(row: int, ids: list[int]) -> bool:
        return len(ids) >= lengths[row]

    with torch.inference_mode():
        specs = UNIFORM
        kept = _frozen(model, specs, "original")
        ref = greedy(model, _frozen(model, specs, "original"), 12, (), finished)
        got = greedy(model, kept, 12, (), finished, release=True)
    assert got == ref
    assert [len(ids) for ids in got] == lengths
    # the rows left the batch: the longest answer decoded alone at the end
    assert kept.cache.layers[0].batch_size == 1
    assert len(kept.policies) == len(specs)  # the caller's record still names every row
