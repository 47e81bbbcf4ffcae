"""Where a decode step's time goes: cProfile of EvictingCache's decode loop against DynamicCache.

Prefills each arm at the budget, then profiles `--steps` one-token forwards per arm (the
arms take turns step by step, as in `decode_overhead.py`) and prints, per arm, the total
profiled time and the kvevict functions with the most time of their own.

    .venv/bin/python benchmarks/profile_decode.py --budget 512 --steps 48 --arms window,streamingllm
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch
from decode_overhead import make, use

from kvevict import load_model, load_tokens
from kvevict.eval.forward import body


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--arms", default="window,streamingllm")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda, cuda:1 ...")
    parser.add_argument("--top", type=int, default=14)
    args = parser.parse_args()
    arms = ["dynamic", *(a for a in args.arms.split(",") if a and a != "dynamic")]
    model, tokenizer = load_model(args.model, device=args.device)
    tokens, _ = load_tokens("pg-essays", tokenizer, args.budget + args.steps + 1)
    tokens = tokens.to(args.device)
    profiles = {arm: cProfile.Profile() for arm in arms}
    with torch.inference_mode():
        caches = {arm: make(model, arm, args.budget, args.steps, tokens) for arm in arms}
        for step in range(args.steps):
            for k in range(len(arms)):
                arm = arms[(step + k) % len(arms)]
                cache, at = caches[arm]
                use(model, arm)
                profiles[arm].enable()
                body(model, tokens[None, at + step : at + step + 1], cache)
                if tokens.is_cuda:  # the step's kernels inside its own profile
                    torch.cuda.synchronize(tokens.device)
                profiles[arm].disable()
    for arm in arms:
        stats = pstats.Stats(profiles[arm])
        print(f"=== {arm}: {stats.total_tt / args.steps * 1000:.2f} ms/step profiled")
        out = io.StringIO()
        stats.stream = out
        stats.sort_stats("tottime").print_stats(args.top)
        print("\n".join(line for line in out.getvalue().splitlines()[6:] if line.strip()))
        if arm != "dynamic":
            out = io.StringIO()
            stats.stream = out
            stats.sort_stats("cumtime").print_stats("kvevict", args.top)
            print("\n".join(line for line in out.getvalue().splitlines()[6:] if line.strip()))


if __name__ == "__main__":
    main()
