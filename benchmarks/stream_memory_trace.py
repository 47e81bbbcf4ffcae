"""Where a stream's peak memory comes from: the resident set and its high-water mark after every chunk.

`scale.py` reports one peak per length; this logs, for one policy's stream at a real attention shape, the
process's resident set and its high-water mark (`VmRSS`, `VmHWM`) after every forward, one JSON
object per line, so a rise can be placed in the chunk that made it. A high-water mark that rises inside a
chunk while the resident set at the chunk's ends stays put is memory held for the chunk's length only.

    PYTHONPATH=src:benchmarks .venv/bin/python benchmarks/stream_memory_trace.py --policy adakv:snapkv \
        --tokens 10240 --json docs/results/trace-adakv-llama-shape.ndjson
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    from scale import status_mb  # beside this script: (high-water mark, resident set) from /proc/self/status
    from shapes import build, random_ids

    from kvevict.eval.streaming import compare

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--policy", default="adakv:snapkv")
    parser.add_argument("--tokens", type=int, default=10240)
    parser.add_argument("--budget", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--json", required=True, help="the trace, one JSON object per forward")
    args = parser.parse_args()
    model = build(args.model)
    ids = random_ids(args.tokens)
    start = time.perf_counter()
    with open(args.json, "w") as out:
        hwm, rss = status_mb()
        out.write(json.dumps({"model": args.model, "policy": args.policy, "tokens": 0, "rss_mb": rss,
                              "hwm_mb": hwm}) + "\n")

        def turn(stop: int) -> None:
            hwm, rss = status_mb()
            out.write(json.dumps({"tokens": stop, "rss_mb": rss, "hwm_mb": hwm,
                                  "seconds": time.perf_counter() - start}) + "\n")
            out.flush()

        compare(model, ids, [args.policy], args.budget, reference=False, progress=False, on_step=turn,
                chunk=args.chunk)
    rows = [json.loads(line) for line in open(args.json)]
    first, peak = rows[0], max(rows, key=lambda r: r["hwm_mb"])
    print(f"{args.policy} at {args.model}'s shape, {args.tokens:,} tokens: high-water mark {peak['hwm_mb']:.0f} MB "
          f"(reached by token {peak['tokens']:,}), {peak['hwm_mb'] - first['rss_mb']:.0f} MB above the start; "
          f"resident at the chunks' ends {min(r['rss_mb'] for r in rows[1:]):.0f}-"
          f"{max(r['rss_mb'] for r in rows[1:]):.0f} MB")


if __name__ == "__main__":
    main()
