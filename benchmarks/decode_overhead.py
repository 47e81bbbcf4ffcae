"""Time per decode step: EvictingCache under each policy vs transformers' DynamicCache.

Both hold about the same number of entries: the EvictingCache sits at its budget, the
DynamicCache is prefilled to `budget - steps/2` so it averages the budget over the
timed steps. Same model, same tokens, one process; the arms take turns step by step
(in a rotating order), so machine noise hits all of them alike.

    .venv/bin/python benchmarks/decode_overhead.py --budget 512 --steps 64
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache

from kvevict import EvictingCache, load_model, load_tokens
from kvevict.eval.forward import body

ARMS = ["dynamic", "window", "streamingllm", "h2o", "snapkv", "tova", "knorm", "keydiff", "adakv:snapkv", "adakv:h2o"]
# the ratio each arm is built to stay under (docs/benchmarks.md)
TARGETS = {"window": 1.02, "streamingllm": 1.02, "knorm": 1.05, "keydiff": 1.05, "h2o": 1.08, "tova": 1.08,
           "snapkv": 1.08, "adakv:snapkv": 1.3, "adakv:h2o": 1.3}


def make(model, arm: str, budget: int, steps: int, tokens: torch.Tensor):
    if arm == "dynamic":
        cache = DynamicCache(config=model.config)
        use(model, arm)
        body(model, tokens[None, : budget - steps // 2], cache)
        return cache, budget - steps // 2
    cache = EvictingCache(model, arm, budget=budget)
    body(model, tokens[None, :budget], cache)
    return cache, budget


def use(model, arm: str) -> None:
    """transformers' own SDPA for the DynamicCache, kvevict's attention for the rest."""
    model.set_attn_implementation("sdpa" if arm == "dynamic" else "kvevict")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda, cuda:1 ...")
    parser.add_argument("--model", default="smollm2-135m", help="an embedded model (smollm2-135m, gemma3-270m)")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms; 'dynamic' is always measured")
    args = parser.parse_args()
    arms = ["dynamic", *(a for a in args.arms.split(",") if a and a != "dynamic")]
    model, tokenizer = load_model(args.model, device=args.device)
    tokens, _ = load_tokens("pg-essays", tokenizer, args.budget + args.steps + 1)
    tokens = tokens.to(args.device)
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    allocated: dict[str, list[int]] = {}  # an EvictingCache's allocated KV bytes after its prefill, then each step
    with torch.inference_mode():
        for _ in range(args.rounds):
            caches = {}
            for arm in arms:
                caches[arm] = make(model, arm, args.budget, args.steps, tokens)
                if arm != "dynamic":
                    allocated[arm] = [caches[arm][0].memory().allocated_kv_bytes]
            for step in range(args.steps):
                for k in range(len(arms)):
                    arm = arms[(step + k) % len(arms)]
                    cache, at = caches[arm]
                    use(model, arm)
                    t0 = time.perf_counter()
                    body(model, tokens[None, at + step : at + step + 1], cache)
                    if tokens.is_cuda:  # a step is timed when its kernels finished, not when they were queued
                        torch.cuda.synchronize(tokens.device)
                    times[arm].append(time.perf_counter() - t0)
                    if arm != "dynamic":
                        allocated[arm].append(cache.memory().allocated_kv_bytes)
    base = sorted(times["dynamic"])[len(times["dynamic"]) // 2]
    print(f"decode step, {args.model}, budget {args.budget}, batch 1, median of {args.steps * args.rounds} steps")
    print(f"{'cache':<14}{'ms/step':>10}{'vs DynamicCache':>18}{'target':>10}")
    for arm in arms:
        median = sorted(times[arm])[len(times[arm]) // 2]
        target = f"<= {TARGETS[arm]:.2f}x" if arm in TARGETS else ""
        print(f"{arm:<14}{median * 1000:>10.1f}{median / base:>17.3f}x{target:>10}")
    for arm, seen in allocated.items():  # the last round's: memory given back, not only evicted
        print(f"{arm}: allocated KV {seen[0] / 1e6:.2f} MB after prefill, at most {max(seen) / 1e6:.2f} MB "
              f"over {args.steps} decode steps, {seen[-1] / 1e6:.2f} MB at the end")


if __name__ == "__main__":
    main()
