"""What a decode step does, counted rather than timed: torch operators dispatched and Python calls per step.

Counts do not move with the machine's other work, so two revisions of the code compare exactly: run this
with each revision's `src` first on the path. The model is a randomly initialised Llama shaped like
SmolLM2-135M's attention (30 layers by default, 9 query and 3 KV heads of 64 channels) with a small MLP and
vocabulary, since what is counted is the cache's work per layer, not the model's arithmetic. Budget 512,
the cache at its budget (one eviction per layer and step), as in `decode_overhead.py`.

    PYTHONPATH=src .venv/bin/python benchmarks/decode_op_count.py --arms window,knorm,h2o,adakv:snapkv
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvevict import EvictingCache
from kvevict.eval.forward import body


class _Count(TorchDispatchMode):
    """Counts every operator torch dispatches while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket).replace("aten.", "")] += 1
        return func(*args, **(kwargs or {}))


def _arm(model, arm: str, budget: int) -> object:
    if arm == "dynamic":
        model.set_attn_implementation("sdpa")
        return DynamicCache(config=model.config)
    cache = EvictingCache(model, arm, budget=budget)
    model.set_attn_implementation("kvevict")
    return cache


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arms", default="window,knorm,h2o,adakv:snapkv")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=576, intermediate_size=64, num_hidden_layers=args.layers,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    tokens = torch.randint(0, 512, (args.budget + 2 * args.steps + 2,))
    print(f"decode step, {args.layers} layers shaped like SmolLM2-135M's, budget {args.budget}, per step")
    print(f"{'cache':<14}{'operators':>10}{'Python calls':>14}{'of kvevict':>12}  most dispatched")
    with torch.inference_mode():
        for arm in ["dynamic", *(a for a in args.arms.split(",") if a and a != "dynamic")]:
            cache = _arm(model, arm, args.budget)
            body(model, tokens[None, : args.budget], cache)
            at = args.budget
            body(model, tokens[None, at : at + 1], cache)  # the first eviction: what every later step does
            count = _Count()
            with count:
                for s in range(1, args.steps + 1):
                    body(model, tokens[None, at + s : at + s + 1], cache)
            profile = cProfile.Profile()
            profile.enable()
            for s in range(args.steps + 1, 2 * args.steps + 1):
                body(model, tokens[None, at + s : at + s + 1], cache)
            profile.disable()
            stats = pstats.Stats(profile).stats
            calls = sum(v[1] for v in stats.values()) / args.steps
            ours = sum(v[1] for k, v in stats.items() if "kvevict" in k[0]) / args.steps
            top = " ".join(f"{k}:{v / args.steps:.0f}" for k, v in count.ops.most_common(8))
            print(f"{arm:<14}{sum(count.ops.values()) / args.steps:>10.0f}{calls:>14.0f}{ours:>12.0f}  {top}")


if __name__ == "__main__":
    main()
