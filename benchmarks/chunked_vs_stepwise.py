"""Chunked exact streaming vs today's token-by-token path: same stream, same rows, one process.

Arm "stepwise" is `compare(..., chunk=1)`: the policies as rows of one batch, one token
per forward after the prefill (the full-cache reference prefilled in chunks, as before).
Arm "chunked" reads the stream `--chunk` tokens per forward and replays token-by-token
eviction inside each layer. Both give the same numbers (checked here: NLL within 1e-4
relative, same sink loss); the ratio of their wall times is the speed-up. Peak resident
memory is the process's peak while each arm ran (`kvevict.ab.meter`, as a sweep records
it). `--chunks` times the chunked arm at several sizes
(how the default was chosen). Each case also prints its floor: the same rows read by a
plain transformers forward in the same chunks, with nothing evicted.

    .venv/bin/python benchmarks/chunked_vs_stepwise.py --tokens 2000 --budget 256

`--chunked-only` skips the stepwise arm (minutes at 2,000 tokens) and times the chunked arm
and its floor in one run, for the chunked / floor ratio.
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache

from kvevict import compare, load_model, load_tokens
from kvevict.ab.meter import measure
from kvevict.defaults import DEFAULT_CHUNK
from kvevict.eval.forward import body, log_probs


def timed(model, tokens, specs, budget, positions, chunk, reference=True):
    with measure() as cost:
        rows, full = compare(model, tokens, specs, budget, positions, reference=reference, progress=False, chunk=chunk)
    return rows, full, cost.seconds, cost.peak_mb


def plain_forward_seconds(model, tokens: torch.Tensor, rows: int, chunk: int) -> float:
    """The arithmetic alone, the floor of any exact evaluation: `rows` copies of the stream
    through transformers' own SDPA and DynamicCache (no kvevict), `chunk` tokens per forward,
    the log-probabilities of every position computed in blocks as `compare` does. Its keys
    grow to the whole stream, so it does at least the work of a bounded cache's attention."""
    model.set_attn_implementation("sdpa")
    try:
        cache = DynamicCache(config=model.config)
        ids = tokens[None].expand(rows, -1)
        with torch.inference_mode(), measure() as cost:
            for start in range(0, ids.shape[1], chunk):
                hidden = body(model, ids[:, start : start + chunk], cache)
                for lo in range(0, hidden.shape[1], 64):
                    log_probs(model, hidden[:, lo : lo + 64])
    finally:
        model.set_attn_implementation("kvevict")
    return cost.seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda, cuda:1 ...")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--policies", default="window,streamingllm,h2o,snapkv")
    parser.add_argument("--positions", default="original")
    parser.add_argument("--chunk", type=int, default=DEFAULT_CHUNK)
    parser.add_argument("--chunks", default="", help="also time the chunked arms at these sizes, e.g. 16,32,64,128")
    parser.add_argument("--single", default="streamingllm", help="also time this policy alone (empty: skip)")
    parser.add_argument("--floor-only", action="store_true", help="time only each case's plain-forward floor")
    parser.add_argument("--chunked-only", action="store_true",
                        help="skip the slow stepwise arm: time the chunked arm and its floor, side by side")
    args = parser.parse_args()
    model, tokenizer = load_model(args.model, device=args.device)
    tokens, _ = load_tokens("pg-essays", tokenizer, args.tokens)
    tokens = tokens.to(args.device)
    specs = [s for s in args.policies.split(",") if s]
    with torch.inference_mode():  # warm-up, untimed: kernel selection and first allocations
        compare(model, tokens[: args.budget + 64], specs, args.budget, args.positions, progress=False, chunk=32)
    print(f"{args.model}, {args.tokens} tokens, budget {args.budget}, {args.positions} positions, "
          f"rows {','.join(specs)} + the full-cache reference")
    print(f"{'arm':<34}{'seconds':>9}{'peak RSS MB':>13}{'speed-up':>10}")
    cases = [(specs, True, "comparison")]
    if args.single:
        cases.append(([args.single], False, f"{args.single} alone"))
    if args.floor_only:
        for rows_specs, reference, name in cases:
            floor_s = plain_forward_seconds(model, tokens, len(rows_specs) + reference, args.chunk)
            print(f"{name + ', floor: plain forward':<34}{floor_s:>9.1f}")
        return
    if args.chunked_only:
        for rows_specs, reference, name in cases:
            chunk_rows, chunk_full, chunk_s, chunk_mb = timed(model, tokens, rows_specs, args.budget, args.positions,
                                                              args.chunk, reference)
            floor_s = plain_forward_seconds(model, tokens, len(rows_specs) + reference, args.chunk)
            print(f"{name + f', chunked (chunk {args.chunk})':<34}{chunk_s:>9.1f}{chunk_mb:>13.0f}")
            print(f"{'  floor: plain forward, same rows':<34}{floor_s:>9.1f}{'':>13}"
                  f"  chunked / floor = {chunk_s / floor_s:.2f}x")
            print("  ppl " + ", ".join(f"{r.policy.split(':')[0]} {r.ppl:.2f}" for r in chunk_rows)
                  + (f", full {chunk_full.ppl:.2f}" if chunk_full is not None else ""))
        return
    for rows_specs, reference, name in cases:
        step_rows, step_full, step_s, step_mb = timed(model, tokens, rows_specs, args.budget, args.positions, 1,
                                                      reference)
        chunk_rows, chunk_full, chunk_s, chunk_mb = timed(model, tokens, rows_specs, args.budget, args.positions,
                                                          args.chunk, reference)
        for a, b in zip(step_rows, chunk_rows):
            assert torch.allclose(b.nll, a.nll, rtol=1e-4, atol=1e-4), f"{a.policy}: chunked and stepwise disagree"
            assert a.sink_lost_at == b.sink_lost_at, f"{a.policy}: sink loss differs"
        print(f"{name + ', stepwise (chunk 1)':<34}{step_s:>9.1f}{step_mb:>13.0f}{'1.00x':>10}")
        print(f"{name + f', chunked (chunk {args.chunk})':<34}{chunk_s:>9.1f}{chunk_mb:>13.0f}"
              f"{step_s / chunk_s:>9.2f}x")
        print("  ppl " + ", ".join(f"{r.policy.split(':')[0]} {r.ppl:.2f}" for r in chunk_rows)
              + (f", full {chunk_full.ppl:.2f}" if chunk_full is not None else ""))
        floor_s = plain_forward_seconds(model, tokens, len(rows_specs) + reference, args.chunk)
        print(f"{'  floor: plain forward, same rows':<34}{floor_s:>9.1f}{'':>13}{step_s / floor_s:>9.2f}x"
              f"  (the most chunking can give; eviction costs {chunk_s - floor_s:.1f} s of the chunked arm)")
    for size in [int(c) for c in args.chunks.split(",") if c]:
        for rows_specs, reference, name in cases:
            _, _, seconds, peak = timed(model, tokens, rows_specs, args.budget, args.positions, size, reference)
            print(f"{f'{name}, chunked (chunk {size})':<34}{seconds:>9.1f}{peak:>13.0f}")


if __name__ == "__main__":
    main()
