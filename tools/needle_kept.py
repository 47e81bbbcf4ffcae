"""How much of a needle's value each policy keeps when the context is compressed before the question.

docs/leading-policies.md reports that Expected Attention loses the single needle on SmolLM2 even at 81% of the
context, where TOVA and LagKV find it. This reads the first `--samples` niah_single_1 prompts at 2,048 tokens
(`--protocol agnostic`: the context alone is compressed), compresses each with every policy at every budget in
one batch, and prints per policy and budget: over the budgeted layers' KV heads (30 x 3 on SmolLM2), how many
hold every token of the value, and the shares an average head holds of the value's tokens, of the context's
first 64 tokens (the template and the instruction) and of its last 64 (the haystack's end, which the question
follows).

    OMP_NUM_THREADS=2 .venv/bin/python tools/needle_kept.py --budgets 1500,937 \
        --policies expected-attention,tova,lagkv
"""

from __future__ import annotations

import argparse

import torch
from adakv_heads import value_positions

from kvevict import compress, load_model
from kvevict.eval.ruler.grid import RulerGrid, prompts


def held(kept: list[torch.Tensor], row: int, positions: torch.Tensor) -> tuple[int, int, float]:
    """(heads holding every position, heads, mean share held) over `kept`, per layer `[B, H_kv, n]`."""
    shares = [torch.isin(positions, layer[row, h]).float().mean().item()
              for layer in kept for h in range(layer.shape[1])]
    return sum(s == 1.0 for s in shares), len(shares), sum(shares) / len(shares)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--budgets", default="1500,937", help="entries of the context kept")
    parser.add_argument("--policies", default="expected-attention,tova,lagkv")
    args = parser.parse_args()
    specs = args.policies.split(",")
    budgets = [int(b) for b in args.budgets.split(",")]
    model, tokenizer = load_model("smollm2-135m")
    grid = RulerGrid(tasks=["niah_single_1"], lengths=[2048], samples=args.samples)
    rows = {(spec, b): [] for spec in specs for b in budgets}  # per prompt: heads whole, heads, three shares
    for prompt in prompts(grid, tokenizer, None):
        value = prompt.sample.question.answers[0]
        positions = value_positions(prompt.context.tolist(), tokenizer.encode(value, add_special_tokens=False))
        n = prompt.context.numel()
        first, last = torch.arange(64), torch.arange(n - 64, n)
        line = []
        for b in budgets:
            with torch.no_grad():
                kept = compress(model, prompt.context, specs, b).cache.kept_positions()
            for row, spec in enumerate(specs):
                whole, heads, share = held(kept, row, torch.tensor(positions))
                opening, end = held(kept, row, first)[2], held(kept, row, last)[2]
                rows[spec, b].append((whole, heads, share, opening, end))
                line.append(f"{spec}@{b} {whole}/{heads} heads, value {share:.2f} first {opening:.2f} last {end:.2f}")
        print(f"sample {prompt.sample.index}, value at {positions[0]} of {n}: " + "; ".join(line), flush=True)
    for (spec, b), per_prompt in rows.items():
        whole, heads, share, opening, end = (sum(column) for column in zip(*per_prompt))
        print(f"{spec} at {b}: every token of the value in {whole}/{heads} heads; mean share held of the value "
              f"{share / args.samples:.2f}, of the first 64 {opening / args.samples:.2f}, of the last 64 "
              f"{end / args.samples:.2f}")


if __name__ == "__main__":
    main()
