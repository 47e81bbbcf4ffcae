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
}


def base_specs() -> list[str]:
    return [TEST_OPTIONS.get(name, name) for name in REGISTRY]


def bounded_specs() -> list[str]:
    """Every registered bounded policy, bare and under each sink wrapper."""
    bare = [spec for spec in base_specs() if not parse_policy(spec).unbounded]
    return bare + [f"sink2+{spec}" for spec in bare] + [f"sinkauto2+{spec}" for spec in bare]


def neighbours(spec: str, others: list[str]) -> list[str]:
    """Rows to batch `spec` with: `others`, or copies of `spec` when it gives each layer its
    own budget (a layer stores one budget for all rows, so it cannot share a batch)."""
    return [spec] * len(others) if parse_policy(spec).varies_by_layer else others
