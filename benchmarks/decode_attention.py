"""One layer's decode attention: SDPA against the hand path that also returns the probabilities.

Why: H2O and TOVA need each decode query's attention probabilities, which SDPA does not
return, so their layers attend by hand (the kernel's one-query path, `attention_stats.query_attention`,
called by `SlotLayer.attend` on a decode step). This times that hand path beside SDPA on one layer of SmolLM2's shape
(1 row, 9 query heads, 3 KV heads, head dim 64, 513 keys) to say what the probabilities
cost per layer and step, both arms in one process, taking turns.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/decode_attention.py
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from kvevict.attention_stats import query_attention


def per_call_us(fn, calls: int) -> float:
    for _ in range(calls // 10):  # warm-up
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=513)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    query = torch.randn(1, 9, 1, 64, generator=g)
    key = torch.randn(1, 3, args.keys, 64, generator=g)
    value = torch.randn(1, 3, args.keys, 64, generator=g)
    scaling = 64 ** -0.5
    with torch.inference_mode():
        sdpa_out = F.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=True)
        hand_out, _ = query_attention(query, key, value, scaling)
        assert torch.allclose(sdpa_out, hand_out, atol=1e-5), "the hand path must give SDPA's output"
        rows = []
        for r in range(args.rounds):  # the arms take turns
            sdpa = per_call_us(lambda: F.scaled_dot_product_attention(query, key, value, scale=scaling,
                                                                      enable_gqa=True), args.calls)
            hand = per_call_us(lambda: query_attention(query, key, value, scaling), args.calls)
            rows.append((r + 1, sdpa, hand))
    print("| round | SDPA µs | by hand (+ probabilities) µs | ratio |")
    print("|---|---|---|---|")
    for r, sdpa, hand in rows:
        print(f"| {r} | {sdpa:.1f} | {hand:.1f} | {hand / sdpa:.2f}× |")


if __name__ == "__main__":
    main()
