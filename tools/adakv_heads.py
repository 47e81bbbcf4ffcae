"""Where a needle's value survives when Ada-KV shares a layer's allowance among its heads.

docs/results.md reports that Ada-KV over SnapKV, under `aware`, loses a value's middle
digits at 25% where SnapKV keeps them. This reads one niah_single_1 prompt (the question
compressed with the context, as `--protocol aware` does), compresses it with SnapKV and
with Ada-KV at several floors in one batch, and prints per policy: the layers where every
KV head still holds every token of the value, the layers where some token is held by no
head, one layer's split of its allowance, and the greedy answer.

    OMP_NUM_THREADS=2 .venv/bin/python tools/adakv_heads.py --sample 3 --budget 25%
"""

from __future__ import annotations

import argparse

from kvevict.eval.ruler.grid import RulerGrid, prompts
from kvevict.eval.ruler.protocols import decode, prefill
from kvevict.loading.models import load_model
from kvevict.policies.budget import resolve_budget

SPECS = ["snapkv", "adakv:snapkv", "adakv:alpha=0.5:snapkv", "adakv:alpha=1:snapkv"]


def value_positions(ids: list[int], value_ids: list[int]) -> list[int]:
    """The positions of the last occurrence of `value_ids` in `ids` (the needle, after the instruction)."""
    starts = [i for i in range(len(ids)) if ids[i : i + len(value_ids)] == value_ids]
    if not starts:
        raise SystemExit("the value's tokens are not in the prompt as one run: pick another sample")
    return list(range(starts[-1], starts[-1] + len(value_ids)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sample", type=int, default=3)
    parser.add_argument("--budget", default="25%")
    parser.add_argument("--layer", type=int, default=4, help="the layer whose split is printed")
    args = parser.parse_args()
    model, tokenizer = load_model("smollm2-135m")
    grid = RulerGrid(tasks=["niah_single_1"], lengths=[2000], samples=args.sample + 1)
    prompt = list(prompts(grid, tokenizer, None))[-1]
    value = prompt.sample.question.answers[0]
    positions = value_positions(prompt.ids.tolist(), tokenizer.encode(value, add_special_tokens=False))
    context = prompt.ids[:-1]
    entries = resolve_budget(args.budget, context.numel())
    state = prefill(model, context, SPECS, entries, "original")
    print(f"sample {args.sample}: value {value} at positions {positions[0]}..{positions[-1]} of {prompt.ids.numel()}; "
          f"{entries} entries per head")
    print(f"{'policy':24} {'all heads hold it':>18} {'a token no head holds':>22}  layer {args.layer} split  answer")
    summary = []
    for row, spec in enumerate(SPECS):
        whole = gone = 0
        for layer in state.cache.layers:
            kept = layer.kept_positions()[row]  # [H, n], -1 pads
            held = [sum(int((kept[h] == p).any()) for h in range(kept.shape[0])) for p in positions]
            whole += all(c == kept.shape[0] for c in held)
            gone += any(c == 0 for c in held)
        split = state.cache.layers[args.layer].head_lengths()[row].tolist()
        summary.append((spec, whole, gone, split))
    state.cache.freeze(final=True)
    state.feed(model, prompt.ids[-1:])
    answers = decode(model, tokenizer, state, 16, [tokenizer.eos_token_id], True)
    layers = len(state.cache.layers)
    for (spec, whole, gone, split), ids in zip(summary, answers):
        print(f"{spec:24} {whole:>13}/{layers} {gone:>17}/{layers}  {str(split):17} {tokenizer.decode(ids)!r}")


if __name__ == "__main__":
    main()
