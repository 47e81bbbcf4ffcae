"""A long stream under a bounded cache: resident memory stays flat, PPL does not drift.

Runs streaming perplexity over N tokens (the essays repeated as needed) with the cache
in position-shift mode, `--chunk` tokens per forward (exact: the same numbers as one
token per forward, `--chunk 1`), sampling resident memory at 10% and at 100% of the stream, and
prints PPL per window of predictions. The cache is preallocated, so growth between
the two samples should be noise (target < 5%).

    .venv/bin/python benchmarks/long_stream.py --tokens 100000 --budget 512 --policy streamingllm
"""

from __future__ import annotations

import argparse
import json
import os
import time

from kvevict import compare, load_model, load_tokens
from kvevict.defaults import DEFAULT_CHUNK


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=100_000)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--policy", default="streamingllm")
    parser.add_argument("--positions", default="cache")
    parser.add_argument("--window", type=int, default=10_000)
    parser.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help="tokens per forward (1: token by token)")
    parser.add_argument("--json", help="also write the numbers to this file")
    parser.add_argument(
        "--skip", type=int, default=0,
        help="start this many tokens into the text (a fresh run over a later stretch: the control for drift)",
    )
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    tokens, repeated = load_tokens("pg-essays", tokenizer, args.skip + args.tokens, repeat=True)
    tokens = tokens[args.skip :]
    samples: dict[str, float] = {}

    def sample(seen: int) -> None:
        if "10%" not in samples and seen >= args.tokens // 10:
            samples["10%"] = rss_mb()

    t0 = time.perf_counter()
    rows, _ = compare(
        model, tokens, [args.policy], args.budget, args.positions, reference=False, on_step=sample, chunk=args.chunk
    )
    samples["100%"] = rss_mb()
    row = rows[0]
    print(f"{args.policy}, budget {args.budget}, positions {args.positions}, "
          f"{args.tokens} tokens from token {args.skip}, chunk {args.chunk}"
          f"{' (pg-essays repeated to fill the stream)' if repeated else ''}, {time.perf_counter() - t0:.0f} s")
    print(f"resident memory: {samples['10%']:.0f} MB at 10%, {samples['100%']:.0f} MB at 100%: "
          f"growth {100 * (samples['100%'] / samples['10%'] - 1):+.1f}% (target < 5%)")
    print(f"overall ppl {row.ppl:.2f}; max kept {row.max_kept}")
    windows = row.ppl_windows(args.window)
    for w in windows:
        print(f"  predictions {w['start']:>7}-{w['end']:<7} ppl {w['ppl']:.2f}")
    if args.json:
        record = {
            "policy": args.policy, "budget": args.budget, "positions": args.positions, "tokens": args.tokens,
            "skip": args.skip, "chunk": args.chunk,
            "repeated": repeated, "rss_mb": samples, "ppl": row.ppl, "max_kept": row.max_kept,
            "seconds": time.perf_counter() - t0, "windows": windows, "windows_1000": row.ppl_windows(1000),
        }
        with open(args.json, "w") as handle:
            json.dump(record, handle, indent=1)


if __name__ == "__main__":
    main()
