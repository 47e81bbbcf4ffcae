"""The leading policies' costs: prefill (prompt compression) against SnapKV's, decode step against DynamicCache.

Prefill: `compress` of the first `--tokens` tokens of pg-essays to half of them, one policy per call, the
arms taking turns in a rotating order for `--rounds` rounds (median seconds, ratio to SnapKV's median).
Decode: each policy streams `--steps` one-token steps at a hard budget `--budget` (every step evicts, so the
policy scores every step) against transformers' `DynamicCache` holding about as many entries (prefilled to
`budget - steps / 2`), the arms taking turns step by step (median ms per step, ratio to DynamicCache's).
Same model, same tokens, one process.

    .venv/bin/python benchmarks/new_policies.py --tokens 2048 --rounds 3 --budget 512 --steps 32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from kvevict import EvictingCache, load_model, load_tokens
from kvevict.cache.attention import attach
from kvevict.eval.compress import compress
from kvevict.eval.forward import body

POLICIES = ["expected-attention", "lagkv"]


def prefill(model, tokens: torch.Tensor, arms: list[str], rounds: int) -> dict[str, float]:
    """Median seconds of `compress` per arm (SnapKV first), the arms in a rotating order each round."""
    model.set_attn_implementation("kvevict")
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for r in range(rounds):
        for k in range(len(arms)):
            arm = arms[(r + k) % len(arms)]
            t0 = time.perf_counter()
            compress(model, tokens, [arm], "50%")
            times[arm].append(time.perf_counter() - t0)
    return {arm: statistics.median(t) for arm, t in times.items()}


def decode(model, tokens: torch.Tensor, arms: list[str], budget: int, steps: int) -> dict[str, float]:
    """Median seconds per decode step per arm ("dynamic": DynamicCache), the arms taking turns each step."""
    caches = {}
    for arm in arms:
        if arm == "dynamic":
            model.set_attn_implementation("sdpa")
            cache, at = DynamicCache(config=model.config), budget - steps // 2
        else:
            model.set_attn_implementation("kvevict")
            cache, at = EvictingCache(model, arm, budget=budget), budget
        body(model, tokens[None, :at], cache)
        caches[arm] = (cache, at)
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for step in range(steps):
        for k in range(len(arms)):
            arm = arms[(step + k) % len(arms)]
            cache, at = caches[arm]
            model.set_attn_implementation("sdpa" if arm == "dynamic" else "kvevict")
            t0 = time.perf_counter()
            body(model, tokens[None, at + step : at + step + 1], cache)
            times[arm].append(time.perf_counter() - t0)
    return {arm: statistics.median(t) for arm, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--policies", default=",".join(POLICIES))
    args = parser.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    model, tokenizer = load_model("smollm2-135m")
    attach(model)  # kvevict's attention registered, so the arms can switch to it and back
    tokens, _ = load_tokens("pg-essays", tokenizer, max(args.tokens, args.budget + args.steps + 1))
    with torch.inference_mode():
        pre = prefill(model, tokens[: args.tokens], ["snapkv", *policies], args.rounds)
        dec = decode(model, tokens, ["dynamic", "snapkv", *policies], args.budget, args.steps)
    print(f"prefill: compress {args.tokens} tokens to 50%, smollm2-135m, median of {args.rounds} rounds")
    for arm, seconds in pre.items():
        print(f"  {arm:<20}{seconds:>8.2f} s{seconds / pre['snapkv']:>8.2f}x SnapKV")
    print(f"decode: one-token steps at budget {args.budget} (each evicts), median of {args.steps} steps")
    for arm, seconds in dec.items():
        print(f"  {arm:<20}{seconds * 1000:>8.1f} ms{seconds / dec['dynamic']:>8.2f}x DynamicCache")


if __name__ == "__main__":
    main()
