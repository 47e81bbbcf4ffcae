"""KVzip (`kvzip`) through the protocols that compress a context once: needle, generation and lm-eval's
loglikelihood. Each hands the model's tokenizer to the compression, so kvzip runs there and keeps what
`kvevict.compress` keeps for the same context (whose kept sets `test_kvzip.py` holds to a reconstruction
computed by hand); lm-eval's request types that evict as they read or generate refuse it in one line.

A tiny Llama with the embedded tokenizer (its chat template frames the repeat request), from `tiny_dir`.
"""

from __future__ import annotations

from importlib.util import find_spec

import pytest
import torch

from kvevict import KvevictError
from kvevict.eval import generation, needle
from kvevict.eval.compress import compress, greedy
from kvevict.eval.forward import log_probs
from kvevict.eval.prompts import stop_ids


@pytest.fixture(scope="module")
def loaded(tiny_dir):
    from kvevict.loading import load_model

    return load_model(str(tiny_dir))


def held(cache) -> list[torch.Tensor]:
    """Per full-attention layer `[B, H_kv, n]` the positions held."""
    return [p.clone() for p in cache.kept_positions()]


def spy_on_greedy(monkeypatch, module) -> list[list[torch.Tensor]]:
    """What each compressed state the protocol decodes from holds, recorded as `module.greedy` is called."""
    seen: list[list[torch.Tensor]] = []

    def spy(model, state, *args, **kwargs):
        seen.append(held(state.cache))
        return greedy(model, state, *args, **kwargs)

    monkeypatch.setattr(module, "greedy", spy)
    return seen


def same_sets(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_needle_runs_kvzip_and_keeps_what_compress_keeps(loaded, monkeypatch):
    model, tokenizer = loaded
    seen = spy_on_greedy(monkeypatch, needle)
    result = needle.run_needle(model, tokenizer, [64], [0.5], 1, ["kvzip"], ["25%"], progress=False)
    [record] = result.records
    prompt = needle.PromptMaker(tokenizer).make(64, 0.5, 0)
    alone = compress(model, prompt.ids[:-1], "kvzip", "25%", tokenizer=tokenizer)
    alone.feed(model, prompt.ids[-1:])
    same_sets(seen[0], held(alone.cache))
    answer = greedy(model, alone, needle.MAX_NEW_TOKENS, stop_ids(tokenizer))[0]
    assert record["answer"] == tokenizer.decode(answer, skip_special_tokens=True)


def test_generation_runs_kvzip_and_keeps_what_compress_keeps(loaded, monkeypatch):
    model, tokenizer = loaded
    seen = spy_on_greedy(monkeypatch, generation)
    result = generation.run_generation(model, tokenizer, ["kvzip"], ["25%"], length=48, trials=1, max_new_tokens=4,
                                       progress=False)
    [record] = result.records
    prompt = generation.GenPromptMaker(tokenizer).make(48, 0)
    alone = compress(model, prompt.ids[:-1], "kvzip", "25%", tokenizer=tokenizer)
    alone.feed(model, prompt.ids[-1:])
    same_sets(seen[0], held(alone.cache))
    output = greedy(model, alone, 4, stop_ids(tokenizer))[0]
    assert record["output"] == tokenizer.decode(output, skip_special_tokens=True)


lm_eval_installed = pytest.mark.skipif(find_spec("lm_eval") is None,
                                       reason="the lm-eval extra is not installed: pip install kvevict[lm-eval]")


def kvevict_lm(tiny_dir, **args):
    from kvevict.integrations.lmeval import registered

    return registered()(pretrained=str(tiny_dir), **args)


def loglikelihood_by_compress(model, tokenizer, spec: str, budget, context, continuation) -> float:
    state = compress(model, context, spec, budget, tokenizer=tokenizer)
    with torch.inference_mode():
        first = log_probs(model, state.hidden[:, None])  # before the feed moves `hidden` on
        lp = torch.cat([first, log_probs(model, state.feed(model, continuation[:-1]))], dim=1)[0]
    return float(lp.gather(-1, continuation[:, None]).double().sum())


@lm_eval_installed
def test_lm_eval_loglikelihood_runs_kvzip_one_context_at_a_time_as_compress_does(loaded, tiny_dir):
    model, tokenizer = loaded
    lm = kvevict_lm(tiny_dir, policy="kvzip", budget="25%")
    opening = tokenizer.apply_chat_template([{"role": "user", "content": "XYZ"}], tokenize=False).split("XYZ")[0]
    texts = ["The lighthouse keeper walked up the stairs every night and lit the lamp before the ships came in",
             "Paul wrote that the best way to get startup ideas is not to try to think of startup ideas at all"]
    ids = [tokenizer(opening + t)["input_ids"] for t in texts]
    n = min(len(i) for i in ids)
    contexts, continuations = [i[: n - 3] for i in ids], [i[n - 3 : n] for i in ids]
    requests = [(("", ""), c, k) for c, k in zip(contexts, continuations)]  # one batch: same lengths
    got = lm._loglikelihood_tokens(requests)
    for (value, _), c, k in zip(got, contexts, continuations):
        want = loglikelihood_by_compress(model, tokenizer, "kvzip", "25%", torch.tensor(c), torch.tensor(k))
        whole = loglikelihood_by_compress(model, tokenizer, "full", None, torch.tensor(c), torch.tensor(k))
        assert abs(value - want) < 1e-4
        assert abs(value - whole) > 1e-3  # what was evicted mattered: the path compressed


@lm_eval_installed
@pytest.mark.parametrize("call", ["generate_until", "loglikelihood_rolling"])
def test_lm_eval_request_types_that_evict_as_they_go_refuse_it(tiny_dir, call):
    lm = kvevict_lm(tiny_dir, policy="kvzip", budget="25%")
    with pytest.raises(KvevictError, match=f"{call} .*run it on loglikelihood"):
        getattr(lm, call)([])


def test_lm_eval_stream_protocol_refuses_it_before_any_loading():
    from kvevict.integrations.lmeval_args import Settings, split_model_args

    with pytest.raises(KvevictError, match="protocol=stream evicts each context as it reads it"):
        Settings.parse(split_model_args("pretrained=x,policy=kvzip,budget=25%,protocol=stream"))
