"""Sequential sampling against a fixed-n grid on the same task cells: answers, time and decisions.

Runs the task envelope (`kvevict envelope --tasks`) on the embedded model, then answers every
cell the search probed (and the full cache) on the first `--fixed` samples, and judges each
cell at that fixed n with the plain 95% rule, as a fixed grid would. Printed: per cell the two
decisions (inside or not), how many agree, and the answers and answering seconds each arm
needs; the ratio of the sequential search's to the fixed grid's. Both arms in one process, on
one loaded model; the answers are the same records (the fixed grid reuses the samples the
search answered, its cost counts every one of them), so an interrupted run resumes, and the
costs are the answering seconds each record holds.

    .venv/bin/python benchmarks/sequential_sampling.py --task niah_single_1 --length 2048 \\
        --policies streamingllm --fixed 30 --out runs/bench
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvevict import load_model
from kvevict.ab.task_envelope import TaskEnvelopeConfig, context_top, keeper, run_task_envelope
from kvevict.eval.ruler.grid import run_grid
from kvevict.records.schema import RulerRecord, load
from kvevict.report.task_envelope import cells_of, scores
from kvevict.stats.tolerance import Tolerance, judge_accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--task", default="niah_single_1")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--policies", default="streamingllm")
    parser.add_argument("--floor", type=int, default=64)
    parser.add_argument("--resolution", type=float, default=1.5)
    parser.add_argument("--start", type=int, default=20)
    parser.add_argument("--cap", type=int, default=80)
    parser.add_argument("--fixed", type=int, default=80)
    parser.add_argument("--out", default="runs/bench")
    args = parser.parse_args()

    folder = Path(args.out) / "sequential-sampling"  # a rerun resumes it: seconds are read from the records
    config = TaskEnvelopeConfig(model=args.model, task=args.task, length=args.length,
                                policies=args.policies.split(","), floor=args.floor, resolution=args.resolution,
                                start=args.start, cap=args.cap, name=folder.name, out=args.out)
    model, tokenizer = load_model(args.model)
    t0 = time.perf_counter()
    store, records = run_task_envelope(config, model, tokenizer)
    search_wall = time.perf_counter() - t0
    specs = config.check()
    sequential = {(spec, b): c for spec in specs
                  for b, c in cells_of(config.looks(), config.tolerance(), spec, records).items()}
    context = context_top(config, tokenizer, None)

    # the fixed grid: every probed cell and the full cache on the first `fixed` samples
    t0 = time.perf_counter()
    for spec, budget in sorted(sequential):
        done = store.done()
        run_grid(model, tokenizer, config.grid([spec], [budget], args.fixed), done,
                 keeper(store, done, config.dtype))
    fixed_wall = time.perf_counter() - t0
    found = scores(load(store.records()))
    full = found[("full", "full")]
    seconds = {(r.policy, r.budget, r.sample): r.seconds or 0.0 for r in load(store.records())
               if isinstance(r, RulerRecord)}

    agree = 0
    print(f"{args.task} at {args.length} tokens (context {context}), tolerance 5 points; sequential "
          f"looks {config.looks()} at {100 * config.tolerance().confidence:.3g}%, fixed n = {args.fixed} at 95%")
    for (spec, budget), cell in sorted(sequential.items()):
        hits = found[(spec, str(budget))]
        fixed = judge_accuracy([hits[i] for i in range(args.fixed)], [full[i] for i in range(args.fixed)],
                               Tolerance())
        same = cell.inside == (fixed.outcome == "inside")
        agree += same
        print(f"  {spec} at {budget}: sequential {cell.judgement.outcome} (n = {cell.judgement.n}), fixed "
              f"{fixed.outcome} (n = {args.fixed}){'' if same else '  <- differ'}")
    seq_answers = sum(c.judgement.n for c in sequential.values()) + max(c.judgement.n for c in sequential.values())
    fixed_answers = args.fixed * (len(sequential) + 1)
    seq_seconds = sum(s for (p, b, i), s in seconds.items()
                      if (p == "full" and i < max(c.judgement.n for c in sequential.values()))
                      or (p != "full" and i < sequential[(p, int(b))].judgement.n))
    fixed_seconds = sum(s for (p, b, i), s in seconds.items() if i < args.fixed)
    print(f"decisions agree on {agree} of {len(sequential)} cells")
    print(f"answers: sequential {seq_answers}, fixed {fixed_answers}: ratio {seq_answers / fixed_answers:.2f}")
    print(f"answering seconds: sequential {seq_seconds:.0f}, fixed {fixed_seconds:.0f}: ratio "
          f"{seq_seconds / fixed_seconds:.2f} (wall: search {search_wall:.0f} s, fixed grid's extra answers "
          f"{fixed_wall:.0f} s)")


if __name__ == "__main__":
    main()
