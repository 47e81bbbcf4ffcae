"""The four RULER protocols against independent computations on a tiny model.

The batch under test shares one context prefill across its policy rows; each reference
runs the library's plain paths (`compress_prompt` with every row fed, one token per
forward for the stream, one policy per cache for the dialogue), so a shortcut that
changed an answer would show here.
"""

from __future__ import annotations

import pytest
import torch

from kvevict.cache import EvictingCache
from kvevict.errors import KvevictError
from kvevict.eval.compress import compress, compress_prompt, greedy
from kvevict.eval.forward import body
from kvevict.eval.ruler.grid import RulerGrid
from kvevict.eval.ruler.protocols import answer, check_aware, prefill, snapshot
from kvevict.eval.ruler.sample import Prompt, Question, Sample
from kvevict.policies.span import pin_span

from conftest import make_tiny, random_tokens
from support import attn

SPECS = ["window", "streamingllm", "h2o", "snapkv:window=8"]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request, tiny):
    """The tiny Llama, and a tiny Gemma 3 (sliding-window layers beside full ones: the embedded second model)."""
    if request.param == "llama":
        return tiny
    from architectures import Arch

    return Arch("gemma3", ("original",)).build().eval()
NEW = 6


class Words:
    """A tokenizer stand-in: ids print as numbers (never a newline), no stop tokens."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)

    def get_vocab(self):
        return {}

    def convert_tokens_to_ids(self, name):
        return None


def _prompt(questions: int = 0) -> Prompt:
    context, question = random_tokens(120, seed=5), random_tokens(9, seed=6)
    keys = [random_tokens(7, seed=10 + q) for q in range(questions)]
    follow = [random_tokens(11, seed=20 + q) for q in range(questions)]
    sample = Sample("niah_multikey_1", 0, "", Question("", "", ["1"]),
                    [Question("", "", ["1"]) for _ in range(questions)])
    return Prompt(sample, 200, context, question, keys, follow, NEW)


def _tokens(answers, question=0):
    return [a.tokens for a in answers if a.question == question]


class Lines(Words):
    """Ids print as numbers, every id divisible by 4 as a newline: answers run over several lines."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join("\n" if i % 4 == 0 else f" {i}" for i in ids)


@pytest.mark.parametrize("references", [["1"], ["1", "2", "3"]])
def test_one_reference_is_read_to_its_first_line_and_a_list_whole(tiny, references):
    prompt = _prompt()
    prompt.sample.question = Question("", "", references)
    prompt.answer_tokens = 24
    [got] = answer(tiny, Lines(), prompt, ["h2o"], 40, "agnostic")
    ref = compress_prompt(tiny, prompt.ids, ["h2o"], 40, split=prompt.context.numel())
    [whole] = greedy(tiny, ref, 24)  # RULER's reading: the whole answer length
    if len(references) == 1:  # cut after the token that ends the first line with text in it
        ends = [k for k in range(1, len(whole) + 1) if "\n" in Lines().decode(whole[:k]).lstrip()]
        assert ends, "the stand-in never ends a line: pick another seed"
        want = whole[: ends[0]]
        assert got.tokens == want and got.text == Lines().decode(want).strip().split("\n")[0]
    else:
        assert got.tokens == whole and "\n" in got.text and got.text == Lines().decode(whole).strip()


def test_agnostic_equals_compressing_the_context_with_every_row_fed(model):
    prompt = _prompt()
    got = answer(model, Words(), prompt, SPECS, 40, "agnostic")
    ref = compress_prompt(model, prompt.ids, SPECS, 40, split=prompt.context.numel())
    assert _tokens(got) == greedy(model, ref, NEW)
    assert [a.policy for a in got] == [ref_p for ref_p in ref.policies]


def test_aware_compresses_the_question_too(tiny):
    prompt = _prompt()
    got = answer(tiny, Words(), prompt, ["h2o", "snapkv:window=8"], 40, "aware")
    ref = compress_prompt(tiny, prompt.ids, ["h2o", "snapkv:window=8"], 40)
    assert _tokens(got) == greedy(tiny, ref, NEW)
    agnostic = answer(tiny, Words(), prompt, ["h2o", "snapkv:window=8"], 40, "agnostic")
    assert _tokens(agnostic) != _tokens(got)  # the question changed what SnapKV kept


def test_full_cache_is_the_plain_forward(tiny):
    prompt = _prompt()
    got = answer(tiny, Words(), prompt, ["full"], None, "agnostic")
    cache = EvictingCache(tiny, "full", budget=None)
    with torch.inference_mode():
        hidden = body(tiny, prompt.ids[None], cache)[:, -1]
        tokens = []
        for _ in range(NEW):
            token = tiny.lm_head(hidden).argmax(-1)
            tokens.append(int(token))
            hidden = body(tiny, token[:, None], cache)[:, -1]
    assert _tokens(got) == [tokens]


def test_stream_equals_one_token_per_forward(model):
    prompt = _prompt()
    got = answer(model, Words(), prompt, SPECS, 40, "stream", stream_chunk=16)
    cache = EvictingCache(model, SPECS, budget=40)
    rows = len(SPECS)
    with torch.inference_mode():
        for token in prompt.ids.tolist():
            hidden = body(model, torch.tensor([[token]] * rows), cache)[:, -1]
        out = [[] for _ in range(rows)]
        for _ in range(NEW):
            token = model.lm_head(hidden).argmax(-1)
            for row, value in enumerate(token.tolist()):
                out[row].append(value)
            hidden = body(model, token[:, None], cache)[:, -1]
            assert max(layer.n for layer in cache.layers) <= 40
    assert _tokens(got) == out


def test_multi_requests_each_start_from_the_same_compressed_context(model):
    prompt = _prompt(questions=3)
    got = answer(model, Words(), prompt, SPECS, 40, "multi", form="requests")
    for q in range(3):
        ids = torch.cat([prompt.context, prompt.per_key[q]])
        ref = compress_prompt(model, ids, SPECS, 40, split=prompt.context.numel())
        assert _tokens(got, q) == greedy(model, ref, NEW)


def test_multi_turns_equal_each_policy_alone_evicting_throughout(model):
    prompt = _prompt(questions=3)
    got = answer(model, Words(), prompt, SPECS, 40, "multi", form="turns")
    for row, spec in enumerate(SPECS):
        cache = EvictingCache(model, [spec], budget=40)
        with torch.inference_mode():
            hidden = body(model, prompt.context[None], cache)[:, -1]
            for q, ids in enumerate([prompt.per_key[0], *prompt.follow_ups[1:]]):
                hidden = body(model, ids[None], cache)[:, -1]
                tokens = []
                for step in range(NEW):
                    token = model.lm_head(hidden).argmax(-1)
                    tokens.append(int(token))
                    if step < NEW - 1:
                        hidden = body(model, token[:, None], cache)[:, -1]
                    assert max(layer.n for layer in cache.layers) <= 40
                assert _tokens(got, q)[row] == tokens, (spec, q)


def test_multi_aware_requests_answer_as_each_policy_alone(tiny):
    """The batch against the plain path, one policy per cache: the context and the first question (but its
    last token) compressed with that question pinned beside the budget; the first request reads on, each
    later one takes the question back out (`crop`) and reads its own after the context."""
    prompt = _prompt(questions=3)
    context, first = prompt.context, prompt.per_key[0]
    span = first.numel() - 1
    for specs in (["h2o", "snapkv:window=8", "sink4+tova"], ["adakv:snapkv:window=4"]):
        got = answer(tiny, Words(), prompt, specs, 40, "multi", form="aware-requests")
        if len(specs) > 1:  # uniform heads (Ada-KV's fullest head may hold more than the budget)
            assert {a.kept for a in got} == {40}, "the context's entries, the question the request's own"
        for row, spec in enumerate(specs):
            for q in range(3):
                state = compress(tiny, torch.cat([context, first[:-1]]), pin_span(spec, span, context.numel()),
                                 40 + span)
                state.cache.freeze()
                if q:
                    state.cache.crop(-span)
                state.feed(tiny, prompt.per_key[q] if q else first[-1:])
                assert _tokens(got, q)[row] == greedy(tiny, state, NEW)[0], (spec, q)


@pytest.mark.parametrize("spec, floor", [("snapkv:window=4,kernel=7", 1.0),
                                         ("adakv:alpha=0.2:snapkv:window=4,kernel=7", 0.2)])
def test_aware_requests_keep_what_the_first_question_picks_among_the_context(spec, floor):
    """Independent of the engine: with the first question taken back out, each head holds what SnapKV's window
    scores (read from eager attention over the context and the question) pick among the context alone, Ada-KV's
    allocation by hand where the heads share the allowance; every head holds the question before."""
    from test_adakv import reference_keep, snapkv_by_hand

    model = make_tiny(seed=21, kv_heads=2)
    context, question = random_tokens(60, seed=22), random_tokens(6, seed=23)
    tokens = torch.cat([context, question])
    budget, heads = 12, model.config.num_key_value_heads
    state = compress(model, tokens, pin_span(spec, 6, 60), budget + 6)
    before = [layer.kept_positions()[0] for layer in state.cache.layers]
    state.cache.crop(-6)
    assert state.cache.tokens_seen == 60 and state.cache.get_seq_length() == 60
    with attn(model, "eager"), torch.inference_mode():
        attentions = model(tokens[None], output_attentions=True).attentions
    for index, layer in enumerate(state.cache.layers):
        scores = snapkv_by_hand(attentions[index][0].float(), heads, 4, 7)
        expected = reference_keep([list(range(60))] * heads, lambda h, p, s=scores: float(s[h, p]), heads * budget,
                                  int(floor * budget + 1e-9))
        kept = layer.kept_positions()[0]
        for head in range(heads):
            assert set(range(60, 66)) <= set(before[index][head].tolist()), "the question is held whole"
            assert kept[head][kept[head] >= 0].tolist() == sorted(expected[head]), f"layer {index} head {head}"


@pytest.mark.parametrize("positions", ["original", "cache"])
def test_taking_the_question_out_leaves_the_context_as_compressed_alone(tiny, positions):
    """A window behind the pinned question keeps the context's last entries; without the question the cache
    reads on exactly as the context compressed alone does (positions continuing from the context's end, or
    renumbered from the entries kept), the next question's logits equal."""
    context, first, later = random_tokens(100, seed=31), random_tokens(8, seed=32), random_tokens(7, seed=33)
    state = compress(tiny, torch.cat([context, first]), pin_span("window", 8, 100), 30 + 8, positions=positions)
    state.cache.freeze()
    state.cache.crop(-8)
    ref = compress(tiny, context, "window", 30, positions=positions)
    ref.cache.freeze()
    assert [la.kept_positions().tolist() for la in state.cache.layers] == \
        [la.kept_positions().tolist() for la in ref.cache.layers] == [[[list(range(70, 100))] * 2]] * 2
    state.feed(tiny, later)
    ref.feed(tiny, later)
    torch.testing.assert_close(state.next_logits(tiny), ref.next_logits(tiny), rtol=1e-5, atol=1e-5)
    with pytest.raises(KvevictError, match="does not hold all of the 31 latest tokens"):
        compress(tiny, context, "window", 30).cache.crop(-31)  # a window of 30 holds 30 of them
    with pytest.raises(KvevictError, match=r"negative number of latest tokens to remove \(crop\(-5\)\)"):
        compress(tiny, context, "window", 30).cache.crop(5)  # transformers' legacy "crop to a length"


def test_multi_aware_requests_full_cache_serves_the_later_requests_as_requests_do(tiny):
    prompt = _prompt(questions=2)
    got = answer(tiny, Words(), prompt, ["full"], None, "multi", form="aware-requests")
    for q in range(2):
        ref = compress_prompt(tiny, torch.cat([prompt.context, prompt.per_key[q]]), ["full"], None)
        assert _tokens(got, q) == greedy(tiny, ref, NEW), q


def test_multi_aware_requests_refuse_a_model_with_sliding_window_layers():
    from architectures import Arch

    gemma = Arch("gemma3", ("original",)).build().eval()
    with pytest.raises(KvevictError, match="sliding-window layers keep only the last"):
        answer(gemma, Words(), _prompt(questions=2), ["h2o"], 40, "multi", form="aware-requests")


def test_snapshot_is_independent_of_the_original(model):
    prompt = _prompt()
    state = prefill(model, prompt.context, SPECS, 40, "original")
    state.cache.freeze()
    copy = snapshot(state)
    copy.feed(model, prompt.question)
    assert state.cache.tokens_seen == prompt.context.numel()
    assert copy.cache.tokens_seen == prompt.tokens


def test_aware_refuses_policies_that_ignore_attention():
    check_aware(["full", "h2o", "snapkv", "tova"])
    with pytest.raises(KvevictError, match="aware is meaningless for 'window'"):
        check_aware(["h2o", "window"])


@pytest.mark.parametrize("grid, says", [
    (RulerGrid(samples=0), "--samples must be at least 1"),
    (RulerGrid(tasks=["niah_single_9"]), "unknown RULER task 'niah_single_9'"),
    (RulerGrid(budgets=["100%"]), "full cache"),
    (RulerGrid(protocol="multi", tasks=["niah_single_1"]), "protocol multi needs several keys"),
    (RulerGrid(protocol="aware", policies=["window", "snapkv"]), "aware is meaningless"),
    (RulerGrid(protocol="sideways"), "unknown protocol"),
    (RulerGrid(protocol="multi", form="aware-requests", tasks=["niah_multikey_1"], policies=["h2o", "window"]),
     "protocol multi --form aware-requests is meaningless for 'window'"),
    (RulerGrid(protocol="multi", form="sideways", tasks=["niah_multikey_1"]), "unknown multi form"),
])
def test_grid_refuses_before_any_model_work(grid, says):
    with pytest.raises(KvevictError, match=says):
        grid.check()
