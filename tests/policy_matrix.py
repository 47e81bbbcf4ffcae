"""Every registered policy, with the options it is tested at, once (as kvpress lists its presses).

A policy registered in `kvevict.policies.REGISTRY` is in the contract tests the moment
it is registered; `TEST_OPTIONS` only says how to make it fit the small budgets used
there. Each bounded policy also appears wrapped by both sink wrappers.
"""

from __future__ import annotations

from kvevict.policies import REGISTRY, parse_policy

# options that let a policy run at the contract tests' budgets (>= 8)
TEST_OPTIONS = {
    "snapkv": "snapkv:window=2,interval=3",
    "h2o": "h2o:recent=0.25",
    "random": "random:seed=1",
    "pyramidkv": "pyramidkv:window=2,interval=3,beta=2",
    "lagkv": "lagkv:n_sink=1,lag_size=2",
    # the add-BOS that llama.cpp reads from a tokenizer, written out: the tiny models have none
    "llamacpp": "llamacpp:bos=0",
    "ollama": "ollama:bos=0",
    "expected-attention": "expected-attention:n_sink=1,window=3,n_future_positions=4",
}


# wrappers that are not registry names: Ada-KV's head-wise budgets over a policy of each kind
# (accumulated attention, a query window, the last query, keys)
WRAPPED = ["adakv:h2o:recent=0.25", "adakv:snapkv:window=2,interval=3", "adakv:tova", "adakv:keydiff",
           "adakv:lagkv:n_sink=1,lag_size=2", "adakv:expected-attention:n_sink=1,window=3"]
# page-granular eviction (`:page=P`, whole pages at once) over a policy of each kind, both page scores
PAGED = ["h2o:recent=0.25,page=3", "snapkv:window=2,interval=3,page=2,pagescore=max", "tova:page=3", "window:page=4",
         "lagkv:n_sink=1,lag_size=2,page=2", "expected-attention:n_sink=1,window=3,page=2"]


def base_specs() -> list[str]:
    """Every registered policy but those scored by reconstructing a context after its prefill (`kvzip`):
    they never evict as a stream is read, which is what the contract tests feed (`tests/test_kvzip.py`)."""
    names = [name for name in REGISTRY if not parse_policy(name).reconstructs]
    return [TEST_OPTIONS.get(name, name) for name in names] + WRAPPED + PAGED


def position_modes(spec: str) -> list[str]:
    """The position modes `spec` runs in: an engine preset runs in its engine's; per-head budgets refuse
    `cache` (each head would need its own positions)."""
    policy = parse_policy(spec)
    if policy.position_mode is not None:
        return [policy.position_mode]
    return ["original"] if policy.varies_by_head else ["original", "cache"]


def bounded_specs() -> list[str]:
    """Every registered bounded policy, bare and under each sink wrapper (engine presets bare: a preset
    is its engine's whole rule, wrappers refuse it)."""
    bare = [spec for spec in base_specs() if not parse_policy(spec).unbounded]
    wrappable = [spec for spec in bare if not parse_policy(spec).preset]
    return bare + [f"sink2+{spec}" for spec in wrappable] + [f"sinkauto2+{spec}" for spec in wrappable]


def held_after(spec: str, budget: int, chunks: list[int]) -> list[int]:
    """Entries a layer holds after each forward of `chunks` tokens when it evicts at the end of each
    forward (no per-token replay): the policy's schedule (`Policy.evict_to`), the budget for most."""
    policy = parse_policy(spec)
    held, out = 0, []
    for q in chunks:
        held += q
        target = policy.evict_to(budget, held)
        held = held if target is None else target
        out.append(held)
    return out


def neighbours(spec: str, others: list[str]) -> list[str]:
    """Rows to batch `spec` with: `others`, or copies of `spec` when it runs in a batch of its
    own (`Policy.own_batch`: per-layer or per-head budgets)."""
    return [spec] * len(others) if parse_policy(spec).own_batch else others
