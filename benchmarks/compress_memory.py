"""Memory of a compressed prompt: what the cache holds and allocates, and the process's peak.

Each arm compresses the first `--tokens` pg-essays tokens to `--budget` entries
(`kvevict.compress`, one forward), then decodes `--decode` greedy tokens through the
frozen cache. Per arm: the cache's `kv_bytes` (entries held), `allocated_kv_bytes` (its
buffers) and the full cache of the tokens seen, right after compression and after the
decode; the process's peak resident memory above what it held before, during the
prefill+compression and during the decode (`kvevict.ab.meter.measure`: the high-water
mark reset per block). The `chunks` arm feeds the prompt in chunks of `--chunk` tokens
through an `EvictingCache` at the budget (each chunk evicts at its end, as the streaming
path does): the prefill's peak is then bounded by a chunk, not the prompt.
Each arm runs in a fresh process (the allocator keeps what one arm freed resident, which
would hide the next arm's peak); `--arms` are separated by `;` (specs hold commas).

    .venv/bin/python benchmarks/compress_memory.py --tokens 2048 --budget 512 --decode 32
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import torch

from kvevict import EvictingCache, load_model, load_tokens
from kvevict.ab.meter import measure
from kvevict.eval.compress import Compressed, compress
from kvevict.eval.forward import body

ARMS = ["full", "snapkv:window=64,kernel=5,pooling=avg", "adakv:snapkv:window=64,kernel=5,pooling=avg", "chunks"]
MB = 1e6


def resident_mb() -> float:
    text = Path("/proc/self/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)\s+kB", text).group(1)) / 1024


def by_chunks(model, tokens: torch.Tensor, budget: int, chunk: int) -> Compressed:
    """SnapKV at `budget`, the prompt fed `chunk` tokens at a time (each chunk evicts at its end)."""
    spec = ARMS[1]
    cache = EvictingCache(model, spec, budget=budget)
    for start in range(0, tokens.numel(), chunk):
        hidden = body(model, tokens[None, start : start + chunk], cache)
    kept = cache.held_entries()
    cache.freeze()
    return Compressed(cache, hidden[:, -1], tokens.numel(), budget, [spec], kept)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda, cuda:1 ...")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--arms", default=";".join(ARMS))
    parser.add_argument("--warm", action="store_true", help="an untimed forward of --chunk tokens first")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the arm this (child) process runs
    args = parser.parse_args()
    if args.one is None:
        print(f"{args.model}: {args.tokens} pg-essays tokens compressed to {args.budget}, then {args.decode} decode "
              "steps; memory above what the process held before the arm")
        print(f"{'arm':<46}{'kv MB':>8}{'alloc MB':>10}{'full MB':>9}{'prefill peak':>14}"
              f"{'decode peak':>13}{'alloc after decode':>20}", flush=True)
        for arm in args.arms.split(";"):
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", arm], check=True)
        return
    model, tokenizer = load_model(args.model, device=args.device)
    tokens, _ = load_tokens("pg-essays", tokenizer, args.tokens)
    tokens = tokens.to(args.device)
    arm = args.one
    with torch.inference_mode():
        if args.warm:  # the first forward of a process pays one-time costs (kernels, thread pools)
            body(model, tokens[None, : args.chunk], EvictingCache(model, "window", budget=args.chunk))
        before = resident_mb()
        with measure(args.device) as prefill:
            if arm == "chunks":
                state = by_chunks(model, tokens, args.budget, args.chunk)
            else:
                state = compress(model, tokens, arm, "full" if arm == "full" else args.budget)
        after = state.cache.memory()
        with measure(args.device) as decode:
            for _ in range(args.decode):
                state.feed(model, state.next_logits(model).argmax(dim=-1)[:, None])
        final = state.cache.memory()
        name = f"chunks of {args.chunk} ({ARMS[1].split(':')[0]})" if arm == "chunks" else arm
        print(f"{name:<46}{after.kv_bytes / MB:>8.1f}{after.allocated_kv_bytes / MB:>10.1f}"
              f"{after.full_kv_bytes / MB:>9.1f}{prefill.peak_mb - before:>11.1f} MB"
              f"{decode.peak_mb - before:>10.1f} MB{final.allocated_kv_bytes / MB:>17.1f} MB"
              f"   ({prefill.peak_mb_scope})"
              + (f"  device peak: prefill {prefill.device_peak_mb:.1f} MB, decode {decode.device_peak_mb:.1f} MB"
                 if prefill.device_peak_mb is not None else ""))
        del state
        sys.stdout.flush()


if __name__ == "__main__":
    main()
