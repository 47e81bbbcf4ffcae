"""RULER answers: kvevict's shared prefill against one prefill per policy per context.

Both arms answer the same seeded RULER prompts (niah_single_2: essays, one needle) on
the embedded model, under the `agnostic` protocol, for the full cache and 4 policies at
each budget:

* **kvevict**: per prompt, one context prefill for the full cache, the 4 policy rows and
  every budget (one row fed, standing for all; the eviction held back, then a copy of the
  state left whole for the full cache and one compressed at each budget:
  `protocols.answer_budgets`), per budget the question read and the answers decoded as
  rows of one batch, each row leaving the batch when its answer is done;
* **per policy** (kvpress's shape: one pipeline call per press and compression ratio):
  per prompt, the full cache, then every policy at every budget in a cache of its own,
  prefilled and decoded alone.

The arms take turns prompt by prompt in one process (so the machine's load touches both
alike), and every answer is asserted identical between them. Prints a table and the
ratio of the total times.

    .venv/bin/python benchmarks/ruler_shared_prefill.py --length 2128 --samples 2 --budgets 50%,25%

`--qa FILE` answers the first `--samples` lines of a QA file instead (`kvevict ruler --qa`'s
prompts, each at its own length), e.g. the QA run's grid, where one prefill stands for five:

    .venv/bin/python benchmarks/ruler_shared_prefill.py --qa runs/niah-qa-2k.jsonl --samples 20 \
        --budgets 50% --policies snapkv,streamingllm,knorm,tova
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvevict.eval.ruler.framing import framing
from kvevict.eval.ruler.grid import RulerGrid, check_budget, prompts
from kvevict.eval.ruler.protocols import answer, answer_budgets
from kvevict.eval.ruler.qa import QaFile, load_qa
from kvevict.eval.ruler.registry import get_task
from kvevict.eval.ruler.sample import fit
from kvevict.eval.ruler.words import Material
from kvevict.loading import load_model

POLICIES = ["window", "streamingllm", "h2o", "snapkv"]


def shared(model, tokenizer, prompt, budgets, policies) -> dict:
    # None: the full cache, the first budget of the batch
    entries = [None] + [check_budget(prompt, "agnostic", policies, b, "requests", "original") for b in budgets]
    replies = answer_budgets(model, tokenizer, prompt, policies, entries, "agnostic")
    out = {(a.policy, "full"): a.tokens for a in replies[0]}
    for budget, answers in zip(budgets, replies[1:], strict=True):
        for spec, a in zip(policies, answers, strict=True):
            out[(spec, budget)] = a.tokens
    return out


def separate(model, tokenizer, prompt, budgets, policies) -> dict:
    out = {(a.policy, "full"): a.tokens for a in answer(model, tokenizer, prompt, ["full"], None, "agnostic")}
    for budget in budgets:
        entries = check_budget(prompt, "agnostic", policies, budget, "requests", "original")
        for spec in policies:
            [a] = answer(model, tokenizer, prompt, [spec], entries, "agnostic")
            out[(spec, budget)] = a.tokens
    return out


def grid_prompts(args, tokenizer):
    """The prompts both arms answer: the RULER task's seeded samples at `--length`, or the QA file's first lines."""
    if args.qa:
        grid = RulerGrid(qa=QaFile(tuple(load_qa(args.qa))), samples=args.samples)
        yield from prompts(grid, tokenizer, None)
        return
    shape, material = framing(tokenizer), Material()
    for index in range(args.samples):
        yield fit(get_task(args.task), args.length, index, 0, shape, material)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", default="niah_single_2")
    parser.add_argument("--length", type=int, default=2128, help="prompt + answer tokens (2,128: a 2,000-token prompt)")
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--budgets", default="50%,25%")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="the policy rows (one batch: uniform-budget policies; adakv:P alone, its own batch)")
    parser.add_argument("--qa", default="", help="a QA file (kvevict ruler --qa) to answer instead of --task")
    parser.add_argument("--json", default="", help="also write the measurements to this file")
    args = parser.parse_args()
    budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    model, tokenizer = load_model("smollm2-135m")
    rows, totals = [], {"kvevict": 0.0, "per policy": 0.0}
    for prompt in grid_prompts(args, tokenizer):
        index, results = prompt.sample.index, {}
        for arm, run in (("kvevict", shared), ("per policy", separate)):
            torch.manual_seed(0)
            t0 = time.perf_counter()
            results[arm] = run(model, tokenizer, prompt, budgets, policies)
            seconds = time.perf_counter() - t0
            totals[arm] += seconds
            rows.append({"sample": index, "arm": arm, "prompt_tokens": prompt.tokens, "seconds": round(seconds, 2)})
            print(f"sample {index} ({prompt.tokens} prompt tokens): {arm:10s} {seconds:7.1f} s", flush=True)
        differ = [k for k in results["kvevict"] if results["kvevict"][k] != results["per policy"][k]]
        assert not differ, f"answers differ between the arms for {differ}"
    answers = len(results["kvevict"])
    print()
    print(f"| arm | prefills per prompt | answers per prompt | seconds ({args.samples} prompts) |")
    print("|---|---|---|---|")
    print(f"| kvevict (one shared prefill for the full cache and every budget, rows of one batch) | 1 | {answers} | "
          f"{totals['kvevict']:.1f} |")
    print(f"| one prefill per policy per context | {1 + len(budgets) * len(policies)} | {answers} | "
          f"{totals['per policy']:.1f} |")
    ratio = totals["per policy"] / totals["kvevict"]
    print(f"\nkvevict is {ratio:.2f}x faster; every answer identical ({answers * args.samples} answers)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"rows": rows, "totals": totals, "ratio": ratio, "args": vars(args)}, handle, indent=2)


if __name__ == "__main__":
    main()
