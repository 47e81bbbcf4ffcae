"""Every registered policy, with the options it is tested at, once (as kvpress lists its presses).

A policy registered in `kvevict.policies.REGISTRY` is in the contract tests the moment
it is registered; `TEST_OPTIONS` only says how to make it fit the small budgets used
there. Each bounded policy also appears wrapped by both sink wrappers.
"""

from __future__ import annotations

from kvevict.policies import REGISTRY, parse_policy

# options that let a policy run at the contract tests' budgets (>= 8)
TEST_OPTIONS = {"snapkv": "snapkv:window=2,interval=3", "h2o": "h2o:recent=0.25", "random": "random:seed=1"}


def base_specs() -> list[str]:
    return [TEST_OPTIONS.get(name, name) for name in REGISTRY]


def bounded_specs() -> list[str]:
    """Every registered bounded policy, bare and under each sink wrapper."""
    bare = [spec for spec in base_specs() if not parse_policy(spec).unbounded]
    return bare + [f"sink2+{spec}" for spec in bare] + [f"sinkauto2+{spec}" for spec in bare]
