"""H2O's prefill statistics: `attention_mass` against summing `blockwise_probs` (what it did before).

One layer of SmolLM2-135M's shapes on a 1,870-token RULER context (9 query heads, 3 KV
heads, head size 64, every query over every key, causal): the blocked sum of full
softmax rows (`blockwise_probs`, then a sum over queries and heads) and `attention_mass`
(keys past a block's last query skipped, softmax in place, its normalisation folded into
the sum). The arms take turns in one process; the largest relative difference between
their outputs is printed beside the ratio.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/ruler_attention_mass.py
"""

from __future__ import annotations

import argparse
import time

import torch

from kvevict.cache.statistics.probabilities import attention_mass, blockwise_probs


def summed_blocks(query, query_pos, keys, key_pos, scaling):
    b, hkv, n = keys.shape[0], keys.shape[1], keys.shape[2]
    total = torch.zeros(b, hkv, n)
    for _, probs in blockwise_probs(query, query_pos, keys, key_pos, scaling):
        total += probs.sum(dim=(2, 3))
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1870)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    n = args.tokens
    query, keys, pos = torch.randn(1, 9, n, 64, generator=g), torch.randn(1, 3, n, 64, generator=g), torch.arange(n)
    seconds = {"blockwise_probs summed": 0.0, "attention_mass": 0.0}
    out = {}
    for _ in range(args.rounds):
        for arm, fn in (("blockwise_probs summed", summed_blocks), ("attention_mass", attention_mass)):
            t0 = time.perf_counter()
            out[arm] = fn(query, pos, keys, pos, 0.125)
            seconds[arm] += time.perf_counter() - t0
    ref, got = out["blockwise_probs summed"], out["attention_mass"]
    rel = ((got - ref).abs() / ref.abs().clamp_min(1e-12)).max().item()
    print(f"| arm | ms per layer ({n} tokens) | x 30 layers (s) |")
    print("|---|---|---|")
    for arm, total in seconds.items():
        print(f"| {arm} | {1000 * total / args.rounds:.1f} | {30 * total / args.rounds:.2f} |")
    ratio = seconds["blockwise_probs summed"] / seconds["attention_mass"]
    print(f"\nattention_mass is {ratio:.2f}x faster; largest relative difference {rel:.1e}")


if __name__ == "__main__":
    main()
