"""Where a 4-bit KV cache's perplexity goes: quantizer, key grouping, or residual schedule, token by token.

Every arm reads the same tokens one at a time and reports its perplexity against the full cache's. The
real caches (kvevict's `q4:...+full`, transformers' `QuantizedCache` with quanto and with HQQ) sit beside
emulations: a `DynamicCache` that holds every entry at full precision and hands attention, at each step,
the images an arm's choice of quantizer, key grouping and residual schedule would read. Changing one
choice at a time says which one makes the gap.

* quantizer: `hqq` (HQQ's affine min/max, optimiser off, as kvevict) or `quanto` (quanto's MaxOptimizer
  and affine codes, as `QuantizedCache(backend="quanto")`);
* keys: `token` (a key's channels in groups of `group`) or `channel` (KIVI: one channel over blocks of
  `group` tokens); values are always grouped per token;
* schedule: `ring` (the latest `residual` tokens at full precision, kvevict's) or `flush` (full
  precision until `residual` tokens gathered, then all of them quantized: `QuantizedCache`'s).

    python tools/quant_gap.py --tokens 1000 --group 64 --residual 128
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from transformers import DynamicCache, QuantizedCache

from kvevict import EvictingCache, attach, load_model, load_tokens


def affine_image(x: torch.Tensor, dim: int, bits: int) -> torch.Tensor:
    """`x` quantized to `bits` with one scale and zero point per slice along `dim` (min/max), dequantized."""
    low, high = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = ((high - low) / (2**bits - 1)).clamp(min=1e-8)
    return ((x - low) / scale).round().clamp(0, 2**bits - 1) * scale + low


def hqq_image(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Per-token groups of `group` channels through HQQ (optimiser off), as kvevict's `q` storage."""
    from hqq.core.quantize import Quantizer

    codes, meta = Quantizer.quantize(x.reshape(-1, x.shape[-1]), nbits=bits, group_size=group, optimize=False,
                                     axis=1, bitpack=False, device=x.device)
    meta.update(compute_dtype=x.dtype, scale=meta["scale"].to(x.dtype), zero=meta["zero"].to(x.dtype))
    return Quantizer.dequantize(codes, meta).reshape(x.shape)


def quanto_image(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Per-token groups through quanto, as `QuantoQuantizedLayer._quantize` with axis 0."""
    from optimum.quanto import MaxOptimizer, qint2, qint4, quantize_weight

    qtype = {4: qint4, 2: qint2}[bits]
    scale, shift = MaxOptimizer()(x, qtype, 0, group)
    return quantize_weight(x.contiguous(), qtype, 0, scale, shift, group).dequantize()


def per_token(quantizer: str, bits: int, group: int):
    if quantizer == "hqq":
        return lambda x: hqq_image(x, bits, group)
    if quantizer == "quanto":
        return lambda x: quanto_image(x, bits, group)
    return lambda x: affine_image(x.unflatten(-1, (-1, group)), -1, bits).flatten(-2)


def channel_image(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Keys `[B, H, T, D]` (T a multiple of `group`) per channel over blocks of `group` tokens (KIVI)."""
    blocks = x.unflatten(2, (-1, group))  # [B, H, T / group, group, D]
    return affine_image(blocks, 3, bits).flatten(2, 3)


class Emulated:
    """A `DynamicCache` whose `update` returns the images one arm would read; entries held at full precision.

    Per layer it keeps the images of the entries quantized so far (`done`): a per-token image is fixed
    when taken; per-channel key blocks are taken once `group` tokens past the last block are old enough."""

    def __init__(self, config, bits: int, group: int, residual: int, quantizer: str, keys: str, schedule: str):
        self.cache = DynamicCache(config=config)
        self.image = per_token(quantizer, bits, group)
        self.bits, self.group, self.residual, self.keys, self.schedule = bits, group, residual, keys, schedule
        self.done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.cache.update = self.update

    def update(self, key, value, layer, *args, **kwargs):
        k, v = DynamicCache.update(self.cache, key, value, layer, *args, **kwargs)
        total = k.shape[2]
        first = layer not in self.done
        dk, dv = self.done.get(layer, (k[:, :, :0], v[:, :, :0]))
        quantized = dk.shape[2]
        if self.schedule == "ring":
            target = max(0, total - self.residual)
        else:  # flush: all of it at the first update and once `residual` tokens gathered since (QuantizedCache)
            target = total if first or total - quantized >= self.residual else quantized
        if self.keys == "channel":
            target -= (target - quantized) % self.group  # whole blocks of `group` tokens only
        shown = quantized if self.schedule == "flush" else target  # a flushing step reads itself at full precision
        if target > quantized:
            new_k = k[:, :, quantized:target]
            new_k = channel_image(new_k, self.bits, self.group) if self.keys == "channel" else self.image(new_k)
            dk = torch.cat([dk, new_k], 2)
            dv = torch.cat([dv, self.image(v[:, :, quantized:target])], 2)
        self.done[layer] = (dk, dv)
        return torch.cat([dk[:, :, :shown], k[:, :, shown:]], 2), torch.cat([dv[:, :, :shown], v[:, :, shown:]], 2)


def nll_token_by_token(model, tokens: torch.Tensor, cache) -> torch.Tensor:
    """NLL `[T-1]` of each next token, the cache fed one token per forward."""
    out = []
    with torch.inference_mode():
        for i in range(tokens.numel() - 1):
            logits = model(tokens[None, i:i + 1], past_key_values=cache, use_cache=True).logits[0, -1]
            out.append(F.cross_entropy(logits.float()[None], tokens[i + 1:i + 2]))
    return torch.stack(out)


def arms(model, args) -> dict:
    """Each arm changes one choice against its neighbour: kvevict's ring of per-token HQQ keys, the same
    under quanto's quantizer, under QuantizedCache's flush, with keys per channel; then the real caches."""
    b, g, r = args.bits, args.group, args.residual
    spec = f"q{b}:group={g},residual={r}"

    def emulated(quantizer: str, keys: str, schedule: str):
        return lambda: Emulated(model.config, b, g, r, quantizer, keys, schedule).cache

    return {
        "full": lambda: EvictingCache(model, "full", budget=None),
        f"kvevict {spec}+full": lambda: EvictingCache(model, f"{spec}+full", budget=None),
        "QuantizedCache quanto": lambda: QuantizedCache("quanto", model.config, nbits=b, q_group_size=g,
                                                        residual_length=r),
        f"kvevict {spec},keys=channel+full": lambda: EvictingCache(model, f"{spec},keys=channel+full", budget=None),
        "emulated quanto keys=token ring": emulated("quanto", "token", "ring"),
        "emulated hqq keys=token flush": emulated("hqq", "token", "flush"),
        "emulated hqq keys=channel ring": emulated("hqq", "channel", "ring"),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--residual", type=int, default=128)
    parser.add_argument("--only", default="", help="comma-separated substrings: run only arms naming one")
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    tokens, _ = load_tokens("pg-essays", tokenizer, args.tokens)
    table = {}
    wanted = [w for w in args.only.split(",") if w]
    for name, make in arms(model, args).items():
        if wanted and name != "full" and not any(w in name for w in wanted):
            continue
        if name.startswith(("full", "kvevict")):
            attach(model)  # kvevict's attention function, registered in transformers
        else:
            model.set_attn_implementation("sdpa")
        t0 = time.perf_counter()
        table[name] = nll_token_by_token(model, tokens, make())
        print(f"{name:<40} PPL {math.exp(table[name].mean()):8.3f}  "
              f"x{math.exp(table[name].mean() - table['full'].mean()):.4f} of full  "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
