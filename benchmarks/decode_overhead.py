"""Time per decode step: EvictingCache under each policy vs transformers' DynamicCache.

Both hold about the same number of entries: the EvictingCache sits at its budget, the
DynamicCache is prefilled to `budget - steps/2` so it averages the budget over the
timed steps. Same model, same tokens, one process; the arms take turns step by step
(in a rotating order), so machine noise hits all of them alike.

`--models` takes embedded models (`smollm2-135m`, `gemma3-270m`, read on pg-essays) and the random-weight
models at real attention shapes of `shapes.py` (`llama-3.1-8b`, `qwen3-8b`, `gemma-3-12b`: one or two
layers, random ids), measured one after the other in the same run; each has its targets (`TARGETS`).

    .venv/bin/python benchmarks/decode_overhead.py --budget 512 --steps 64
    .venv/bin/python benchmarks/decode_overhead.py --models smollm2-135m@512,llama-3.1-8b@4096 \
        --arms window,knorm,keydiff,h2o,tova,snapkv,adakv:snapkv,q4:group=64,residual=128+window,fp8+window
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache

from kvevict import EvictingCache, load_model, load_tokens
from kvevict.cli.common import split_specs
from kvevict.eval.forward import body

ARMS = ["dynamic", "window", "streamingllm", "h2o", "snapkv", "tova", "knorm", "keydiff", "adakv:snapkv", "adakv:h2o"]
#: the arms of the real-shape run: every family, and the storage forms as deployed (4 bits: groups of 64, the
#: latest 128 tokens at full precision; fp8), over the window so the ratio is the storage's own
SHAPE_ARMS = ["window", "knorm", "keydiff", "h2o", "tova", "snapkv", "adakv:snapkv", "q4:group=64,residual=128+window",
              "fp8+window"]
# the ratio each arm is built to stay under (docs/benchmarks.md): on the embedded models, where Python's share
# of a step is largest; at the real attention shapes, where the model's own step is the larger part
EMBEDDED_TARGETS = {"window": 1.02, "streamingllm": 1.02, "knorm": 1.05, "keydiff": 1.05, "h2o": 1.08, "tova": 1.08,
                    "snapkv": 1.08, "adakv:snapkv": 1.3, "adakv:h2o": 1.3}
SHAPE_TARGETS = {"window": 1.02, "streamingllm": 1.02, "knorm": 1.03, "keydiff": 1.03, "h2o": 1.05, "tova": 1.05,
                 "snapkv": 1.05, "adakv:snapkv": 1.15, "adakv:h2o": 1.15, "q4:group=64,residual=128+window": 1.2,
                 "fp8+window": 1.2}
TARGETS = EMBEDDED_TARGETS  # what the embedded models' runs (and the scripts importing it) read


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


def load(name: str, device: str, dtype: torch.dtype | None, tokens: int) -> tuple[object, torch.Tensor, dict]:
    """The model `name` on `device`, `tokens` ids to feed it and its targets: an embedded model on pg-essays in
    its own dtype (or `dtype`), a real attention shape (`shapes.SHAPES`) with random weights and ids."""
    from shapes import SHAPES, build, random_ids  # beside this script

    if name in SHAPES:
        model = build(name, device, dtype or torch.float32)
        return model, random_ids(tokens).to(device), SHAPE_TARGETS
    model, tokenizer = load_model(name, device=device, dtype=None if dtype is None else str(dtype).split(".")[-1])
    ids, _ = load_tokens("pg-essays", tokenizer, tokens)
    return model, ids.to(device), EMBEDDED_TARGETS


def step_times(model, tokens: torch.Tensor, arms: list[str], budget: int, steps: int, rounds: int) -> dict:
    """Seconds of every decode step of every arm (`dynamic` first), the arms taking turns step by step in a
    rotating order; and per EvictingCache arm its allocated KV bytes after the prefill, then after each step
    (the last round's)."""
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    allocated: dict[str, list[int]] = {}
    with torch.inference_mode():
        for _ in range(rounds):
            caches = {}
            for arm in arms:
                caches[arm] = make(model, arm, budget, steps, tokens)
                if arm != "dynamic":
                    allocated[arm] = [caches[arm][0].memory().allocated_kv_bytes]
            for step in range(steps):
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
    return {"times": times, "allocated": allocated}


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda, cuda:1 ...")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 (default: the model's own; float32 shapes)")
    parser.add_argument("--models", "--model", default="smollm2-135m",
                        help="comma-separated: embedded models (smollm2-135m, gemma3-270m) and real attention shapes "
                             "with random weights (llama-3.1-8b, qwen3-8b, gemma-3-12b); NAME@BUDGET gives one "
                             "model its own budget")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms; 'dynamic' is always measured")
    args = parser.parse_args()
    arms = ["dynamic", *(a for a in split_specs(args.arms) if a and a != "dynamic")]
    dtype = None if args.dtype is None else getattr(torch, args.dtype)
    for named in args.models.split(","):
        name, _, own = named.partition("@")
        budget = int(own) if own else args.budget
        model, tokens, targets = load(name, args.device, dtype, budget + args.steps + 1)
        measured = step_times(model, tokens, arms, budget, args.steps, args.rounds)
        times, allocated = measured["times"], measured["allocated"]
        base = median(times["dynamic"])
        print(f"decode step, {name}, budget {budget}, batch 1, median of {args.steps * args.rounds} steps")
        print(f"{'cache':<34}{'ms/step':>10}{'vs DynamicCache':>18}{'target':>10}")
        for arm in arms:
            step = median(times[arm])
            target = f"<= {targets[arm]:.2f}x" if arm in targets else ""
            print(f"{arm:<34}{step * 1000:>10.1f}{step / base:>17.3f}x{target:>10}")
        for arm, seen in allocated.items():  # the last round's: memory given back, not only evicted
            print(f"{arm}: allocated KV {seen[0] / 1e6:.2f} MB after prefill, at most {max(seen) / 1e6:.2f} MB "
                  f"over {args.steps} decode steps, {seen[-1] / 1e6:.2f} MB at the end")
        del model


if __name__ == "__main__":
    main()
