"""Time per decode step: a quantized cache (`qB+P`) against the unquantized step of the same policy P.

Both arms sit at the budget after one prefill of the same tokens, in one process; they take turns
step by step (in a rotating order), so machine noise hits them alike. The quantized arms also time
the storage form's own work per step: dequantizing what is held into the forward's working copy
(`QuantizedStorage.begin`) and quantizing the new entry (`written`), summed over the layers.

    .venv/bin/python benchmarks/quant_decode.py --budget 512 --steps 48 --rounds 2
    .venv/bin/python benchmarks/quant_decode.py --budget 2048 --policies h2o \
        --form q4:group=64,residual=128 --form q4:group=64,residual=128,keys=channel
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from kvevict import EvictingCache, load_model, load_tokens
from kvevict.cache.storage.quantized import QuantizedStorage
from kvevict.eval.forward import body

TARGET = 1.3  # the quantized step against the unquantized one


class Timed:
    """Seconds spent in the storage form's `begin` and `written`, while `on` is set (the quantized arms)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.on = False
        self._methods = {name: getattr(QuantizedStorage, name) for name in ("begin", "written")}
        for name, method in self._methods.items():
            setattr(QuantizedStorage, name, self._wrap(method))

    def _wrap(self, method):
        def timed(storage, *args):
            t0 = time.perf_counter()
            out = method(storage, *args)
            if self.on:
                self.seconds += time.perf_counter() - t0
            return out
        return timed

    def restore(self) -> None:
        for name, method in self._methods.items():
            setattr(QuantizedStorage, name, method)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default="smollm2-135m", help="an embedded model (smollm2-135m, gemma3-270m)")
    parser.add_argument("--policies", default="sink4+window,h2o", help="comma-separated policies P")
    parser.add_argument("--bits", default="4,8", help="comma-separated widths: arms qB+P beside P")
    parser.add_argument("--form", action="append", default=[],
                        help="a storage form's spec for arms FORM+P beside P, instead of --bits (repeatable), "
                             "e.g. --form q4:group=64,residual=128 --form q4:group=64,residual=128,keys=channel")
    args = parser.parse_args()
    policies = args.policies.split(",")
    forms = args.form or [f"q{b}" for b in args.bits.split(",")]
    arms = [arm for p in policies for arm in (p, *(f"{form}+{p}" for form in forms))]
    model, tokenizer = load_model(args.model)
    tokens, _ = load_tokens("pg-essays", tokenizer, args.budget + args.steps + 1)
    times: dict[str, list[float]] = defaultdict(list)
    storage_seconds: dict[str, float] = defaultdict(float)
    held: dict[str, int] = {}
    timer = Timed()
    try:
        with torch.inference_mode():
            for _ in range(args.rounds):
                caches = {arm: EvictingCache(model, arm, budget=args.budget) for arm in arms}
                for cache in caches.values():
                    body(model, tokens[None, : args.budget], cache)
                for step in range(args.steps):
                    for k in range(len(arms)):
                        arm = arms[(step + k) % len(arms)]
                        timer.on, timer.seconds = arm not in policies, 0.0
                        t0 = time.perf_counter()
                        body(model, tokens[None, args.budget + step : args.budget + step + 1], caches[arm])
                        times[arm].append(time.perf_counter() - t0)
                        storage_seconds[arm] += timer.seconds
                held = {arm: cache.memory().kv_bytes for arm, cache in caches.items()}
    finally:
        timer.restore()

    def median(arm: str) -> float:
        return sorted(times[arm])[len(times[arm]) // 2]

    print(f"decode step, {args.model}, budget {args.budget}, batch 1, median of {args.steps * args.rounds} steps")
    print(f"{'cache':<44}{'ms/step':>9}{'vs P':>9}{'target':>9}{'dequant+quant ms':>18}{'KV MB held':>12}")
    for p in policies:
        for arm in (p, *(f"{form}+{p}" for form in forms)):
            ratio = median(arm) / median(p)
            own = storage_seconds[arm] / len(times[arm]) * 1000 if arm != p else 0.0
            target = f"<= {TARGET:.1f}x" if arm != p else ""
            print(f"{arm:<44}{median(arm) * 1000:>9.1f}{ratio:>8.3f}x{target:>9}{own:>18.2f}{held[arm] / 1e6:>12.2f}")


if __name__ == "__main__":
    main()
