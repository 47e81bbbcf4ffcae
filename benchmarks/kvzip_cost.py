"""KVzip's cost: compressing a context with its reconstruction pass, against SnapKV compressing the same tokens.

Each arm is `compress` of the first `--tokens` tokens of pg-essays to half of them on the embedded SmolLM2:
`snapkv` (one prefill, uniform layers), `adakv:snapkv` (one prefill through the ragged per-head layers
KVzip also uses, so the two differ by the reconstruction alone) and `kvzip` (the prefill held back, one
repeat forward per 2,048-token chunk asking the model to repeat the context, then the selection across
layers). The arms take turns in a rotating order for `--turns` turns; the median seconds and the ratio
to SnapKV's median are printed, with the tokens KVzip's repeat forwards fed. Then a decode step from each
compressed state (frozen: attention alone) against `DynamicCache` holding the whole context, the arms
taking turns step by step. Same model, same tokens, one process.

    .venv/bin/python benchmarks/kvzip_cost.py --tokens 1024 --turns 3 --steps 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from kvevict import load_model, load_tokens
from kvevict.cache.attention import attach
from kvevict.eval.compress import compress
from kvevict.eval.forward import body
from kvevict.eval.reconstruction import repeat_framing, repeat_inputs

ARMS = ["snapkv", "adakv:snapkv", "kvzip"]


def prefill(model, tokenizer, tokens: torch.Tensor, turns: int) -> dict[str, float]:
    """Median seconds of `compress` to 50% per arm, the arms in a rotating order each turn."""
    model.set_attn_implementation("kvevict")
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for r in range(turns):
        for k in range(len(ARMS)):
            arm = ARMS[(r + k) % len(ARMS)]
            t0 = time.perf_counter()
            compress(model, tokens, arm, "50%", tokenizer=tokenizer)
            times[arm].append(time.perf_counter() - t0)
    return {arm: statistics.median(t) for arm, t in times.items()}


def decode(model, tokenizer, tokens: torch.Tensor, steps: int) -> dict[str, float]:
    """Median seconds per decode step from each compressed state and from a full `DynamicCache`."""
    states = {arm: compress(model, tokens, arm, "50%", tokenizer=tokenizer) for arm in ARMS}
    model.set_attn_implementation("sdpa")
    full = DynamicCache(config=model.config)
    with torch.inference_mode():
        body(model, tokens[None], full)
    arms = [*ARMS, "dynamic"]
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    with torch.inference_mode():
        for step in range(steps):
            token = tokens[step : step + 1][None]
            for k in range(len(arms)):
                arm = arms[(step + k) % len(arms)]
                model.set_attn_implementation("sdpa" if arm == "dynamic" else "kvevict")
                t0 = time.perf_counter()
                if arm == "dynamic":
                    body(model, token, full)
                else:
                    states[arm].feed(model, token)
                times[arm].append(time.perf_counter() - t0)
    return {arm: statistics.median(t) for arm, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    model, tokenizer = load_model("smollm2-135m")
    attach(model)  # registers kvevict's attention function, so the arms can switch between it and SDPA
    tokens, _ = load_tokens("pg-essays", tokenizer, args.tokens)
    fed = sum(ids.numel() for _, _, ids in repeat_inputs(tokens, repeat_framing(tokenizer), 2048))
    print(f"{args.tokens} tokens compressed to 50%, {args.turns} turns, {torch.get_num_threads()} threads; "
          f"KVzip's repeat forwards feed {fed} tokens")
    times = prefill(model, tokenizer, tokens, args.turns)
    for arm, seconds in times.items():
        print(f"compress {arm:14s} {seconds:8.2f} s  {seconds / times['snapkv']:6.2f}x snapkv")
    steps = decode(model, tokenizer, tokens, args.steps)
    for arm, seconds in steps.items():
        print(f"decode step {arm:14s} {seconds * 1e3:8.2f} ms  {seconds / steps['dynamic']:6.2f}x DynamicCache")


if __name__ == "__main__":
    main()
