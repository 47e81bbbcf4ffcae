"""Policy capabilities as one object: what a wrapper derives, the full-cache predicate, and which
policies may share a batch, checked against what the cache itself accepts."""

from __future__ import annotations

import pytest
import torch

from kvevict import EvictingCache
from kvevict.errors import KvevictError
from kvevict.policies import REGISTRY, is_full_cache, parse_policy, shared_batches
from kvevict.policies.capabilities import FIELDS, Capabilities, may_share_batch

from conftest import random_tokens

WRAPPERS = ["sink4+", "sinkauto4+", "q4+", "adakv:", "sink2+adakv:"]
SPECS = ["full", "window", "h2o", "snapkv", "tova", "knorm", "keydiff", "lagkv", "expected-attention", "pyramidkv",
         "random", "llamacpp:bos=1", "trtllm", "vllm-swa"]


def _parsed(spec: str):  # None: a combination the registry refuses (adakv over a preset, ...)
    try:
        return parse_policy(spec)
    except KvevictError:
        return None


VALID = [s for s in [w + s for w in ["", *WRAPPERS] for s in SPECS] + ["h2o:page=16", "sink4+h2o:page=8"]
         if _parsed(s) is not None]


@pytest.mark.parametrize("spec", VALID)
def test_every_field_reads_the_same_as_an_attribute_and_through_the_object(spec):
    policy = parse_policy(spec)
    caps = policy.capabilities
    assert isinstance(caps, Capabilities)
    for name in FIELDS:
        assert getattr(policy, name) == getattr(caps, name), name
    assert policy.own_batch == caps.own_batch


def test_a_wrapper_takes_its_inner_policys_needs_and_keeps_its_own_rule():
    """What the cache must carry for the inner policy (statistics, remembered queries, keys) comes through every
    wrapper; what belongs to the inner rule alone (never evicting, an engine's rule) does not."""
    for name in ("h2o", "snapkv", "knorm", "keydiff"):
        inner = parse_policy(name).capabilities
        for wrapper in ("sink4+", "adakv:", "q8+"):
            caps = parse_policy(wrapper + name).capabilities
            assert (caps.stats, caps.query_window, caps.reads_keys, caps.arrival_stat) == (
                inner.stats, inner.query_window, inner.reads_keys, inner.arrival_stat)
    assert parse_policy("sink4+window").fifo_after == 4 and parse_policy("adakv:window").fifo_after is None
    assert parse_policy("q4+full").unbounded and not parse_policy("sink4+h2o").unbounded
    assert parse_policy("sinkauto4+window").needs_attention and not parse_policy("window").needs_attention
    assert parse_policy("adakv:h2o").varies_by_head and not parse_policy("adakv:h2o").static_scores


def test_a_field_a_policy_cannot_answer_yet_raises_its_own_error_through_a_wrapper_too():
    """llama.cpp's pinned tokens depend on the model's add-BOS: unknown until it is given, through `q4+` too,
    while every other field answers."""
    for spec in ("llamacpp", "q4+llamacpp"):
        policy = parse_policy(spec)
        with pytest.raises(KvevictError, match="add-BOS"):
            _ = policy.pinned
        assert policy.own_batch and policy.preset
    assert parse_policy("q4+llamacpp:bos=1").pinned == parse_policy("llamacpp:bos=1").pinned


def test_the_full_cache_is_full_alone_not_a_quantized_one():
    assert is_full_cache("full") and is_full_cache(" FULL ")
    assert not is_full_cache("q4+full") and not is_full_cache("q8:group=32+full")
    assert parse_policy("q4+full").unbounded  # it never evicts: a storage form of the full cache
    assert not any(is_full_cache(name) for name in REGISTRY if name != "full" and _parsed(name) is not None)


def test_batches_are_what_one_cache_accepts(tiny):
    """Every batch `shared_batches` forms is accepted by one EvictingCache, and two of its batches of uniform
    policies put together are refused by the cache: the predicate and the cache agree."""
    q4, q8 = "q4:group=16", "q8:group=16"  # the tiny model's heads hold 16 channels
    specs = ["window", f"{q4}+full", "h2o", f"{q4}+h2o", f"{q8}+window", "adakv:snapkv", f"{q4}+window", "pyramidkv"]
    batches = shared_batches(specs)
    assert sorted(s for batch in batches for s in batch) == sorted(specs)
    assert batches == [["window", "h2o"], [f"{q4}+h2o", f"{q4}+window"], [f"{q4}+full"], [f"{q8}+window"],
                       ["adakv:snapkv"], ["pyramidkv"]]
    tokens = random_tokens(24)[None]
    with torch.inference_mode():
        for batch in batches:
            EvictingCache(tiny, batch, budget=64)  # accepted
            assert may_share_batch([parse_policy(s).capabilities for s in batch])
        with pytest.raises(KvevictError):
            cache = EvictingCache(tiny, [*batches[1], *batches[2]], budget=64)
            tiny(tokens.expand(3, -1), past_key_values=cache, use_cache=True)
    assert not may_share_batch([parse_policy(s).capabilities for s in ("q4+h2o", "q4+full")])
    assert not may_share_batch([parse_policy(s).capabilities for s in ("h2o", "adakv:h2o")])
