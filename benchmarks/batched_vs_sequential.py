"""Throughput of N policies batched as rows of one forward vs run one after another.

On a CPU, decoding is bound by reading the weights; rows of one batch share that read.
Both arms run here, in one process, on the same tokens, and the ratio is printed. Both
decode token by token (`chunk=1`): this measures the batching of rows, not chunking
(that is benchmarks/chunked_vs_stepwise.py).

    .venv/bin/python benchmarks/batched_vs_sequential.py --tokens 400 --budget 128
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

from kvevict import compare, load_model, load_tokens

POLICIES = ["window", "streamingllm", "random", "h2o", "sink4+h2o", "snapkv"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--budget", type=int, default=128)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    tokens, _ = load_tokens("pg-essays", tokenizer, args.tokens)
    steps = len(POLICIES) * (args.tokens - 1)
    # Warm-up, untimed: the first forwards of a process pay for kernel selection and
    # allocations, which would otherwise be charged to whichever arm runs first.
    warm = tokens[: args.budget + 32]
    compare(model, warm, POLICIES, args.budget, reference=False, progress=False, chunk=1)
    compare(model, warm, POLICIES[:1], args.budget, reference=False, progress=False, chunk=1)

    t0 = time.perf_counter()
    batched, _ = compare(model, tokens, POLICIES, args.budget, reference=False, progress=False, chunk=1)
    batched_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    sequential = [
        compare(model, tokens, [p], args.budget, reference=False, progress=False, chunk=1)[0][0] for p in POLICIES
    ]
    sequential_s = time.perf_counter() - t0

    for a, b in zip(batched, sequential):
        assert torch.allclose(a.nll, b.nll, rtol=1e-3, atol=1e-3), f"{a.policy}: batched and sequential disagree"
    table = Table(title=f"{len(POLICIES)} policies, {args.tokens} tokens, budget {args.budget}, {args.model}")
    for column in ("arm", "seconds", "predictions/s"):
        table.add_column(column)
    table.add_row("sequential", f"{sequential_s:.1f}", f"{steps / sequential_s:.1f}")
    table.add_row("batched", f"{batched_s:.1f}", f"{steps / batched_s:.1f}")
    Console().print(table)
    print(f"batched / sequential throughput: {sequential_s / batched_s:.2f}x (target >= 4x)")


if __name__ == "__main__":
    main()
