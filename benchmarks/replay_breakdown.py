"""Where the chunked arm's time goes: the replay inside the layers against everything else.

Runs the chunked arm of `chunked_vs_stepwise.py` (the rows of one batch and the full-cache
reference, `--chunk` tokens per forward) once, untimed warm-up first, with the layers'
replay entry (`EvictingLayer.replay`) and its stepping algorithms timed with `perf_counter`.
What is not inside the replay is the model's own arithmetic and the evaluation that calls it, the
part `chunked_vs_stepwise.py --chunked-only` compares with its floor.

    PYTHONPATH=src .venv/bin/python benchmarks/replay_breakdown.py --tokens 2000 --budget 256
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from collections import Counter

import torch

import kvevict.cache.replay.chunk as replay
import kvevict.cache.replay.paths as replay_paths
from kvevict import compare, load_model, load_tokens
from kvevict.cache.layers.uniform import EvictingLayer
from kvevict.defaults import DEFAULT_CHUNK

PARTS = [
    (EvictingLayer, "replay", "replay (all)"),
    (replay, "steps_fixed_keys", "stepping, fixed keys"),
]
#: the registered fast paths (`replay_paths.PATHS`), each timed under its own name
PATH_LABELS = {"closed form": "closed form", "by slot": "stepping by slot"}


def timed(function, label: str, spent: Counter, calls: Counter | None = None):
    """`function` adding its seconds to `spent[label]` (and one to `calls[label]`) at every call."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - start
            if calls is not None:
                calls[label] += 1

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--policies", default="window,streamingllm,h2o,snapkv")
    parser.add_argument("--chunk", type=int, default=DEFAULT_CHUNK)
    args = parser.parse_args()
    spent: Counter = Counter()
    calls: Counter = Counter()
    for owner, name, label in PARTS:
        setattr(owner, name, timed(getattr(owner, name), label, spent, calls))
    replay_paths.PATHS = tuple(dataclasses.replace(p, run=timed(p.run, PATH_LABELS[p.name], spent, calls))
                               for p in replay_paths.PATHS)
    model, tokenizer = load_model(args.model)
    tokens, _ = load_tokens("pg-essays", tokenizer, args.tokens)
    specs = [s for s in args.policies.split(",") if s]
    with torch.inference_mode():
        compare(model, tokens[: args.budget + 64], specs, args.budget, progress=False, chunk=32)  # warm-up
        spent.clear()
        calls.clear()
        start = time.perf_counter()
        compare(model, tokens, specs, args.budget, progress=False, chunk=args.chunk)
        total = time.perf_counter() - start
    steps = (args.tokens - args.budget) * len(model.model.layers)
    print(f"{args.model}, {args.tokens} tokens, budget {args.budget}, chunk {args.chunk}, rows {','.join(specs)} "
          f"+ the full-cache reference")
    print(f"chunked arm {total:.1f} s; outside the replay {total - spent['replay (all)']:.1f} s")
    for label, seconds in spent.most_common():
        print(f"{label:<22}{seconds:>8.1f} s{calls[label]:>7} calls")
    print(f"replay per layer and evicting step: {spent['replay (all)'] / steps * 1e6:.0f} us "
          f"({args.tokens - args.budget} steps x {len(model.model.layers)} layers)")


if __name__ == "__main__":
    main()
