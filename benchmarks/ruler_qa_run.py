"""The QA run's wall time: `kvevict ruler --qa FILE` on the embedded model, one or two source trees taking turns.

The command a user runs on a QA file of 20 niah_single_1 prompts of about 1.9K SmolLM2 tokens
(tools/niah_qa.py writes it), the full cache and four policies at half the context:

    kvevict ruler --qa FILE --samples 20 --protocol agnostic --policies snapkv,streamingllm,knorm,tova \\
        --budgets 50%

Each run is the whole command as a user starts it (a fresh process: imports, model load, answers,
report), in a fresh run folder (a folder that holds answers would resume, answering nothing). With
two `--src` trees (this checkout's `src` and an older revision's), the arms take turns run by run,
so the machine's load touches both alike, and the ratio of their medians is printed. Every arm's
accuracies (per policy and budget, over the file's lines) must agree, or the script fails.

    PYTHONPATH=src .venv/bin/python tools/niah_qa.py --out runs/niah-qa-2k.jsonl
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/ruler_qa_run.py runs/niah-qa-2k.jsonl --src src \\
        --src OLD/src --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(src: str, args: argparse.Namespace, out: str, name: str) -> tuple[float, list]:
    """Seconds the command takes with `src` first on the path, and its cells (`--json`'s last line)."""
    argv = [sys.executable, "-m", "kvevict.cli", "ruler", "--model", args.model, "--qa", args.qa, "--samples",
            str(args.samples), "--protocol", "agnostic", "--policies", args.policies, "--budgets", args.budgets,
            "--out", out, "--name", name, "--json"]
    env = {**os.environ, "PYTHONPATH": str(Path(src).resolve())}
    t0 = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(f"{src}: the command failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    pooled: dict[tuple[str, str], list[float]] = {}  # (policy, budget) -> [hits, answers] over the cells' lengths
    for cell in json.loads(done.stdout.strip().splitlines()[-1])["cells"]:
        hits = pooled.setdefault((cell["policy"], cell["budget"]), [0.0, 0])
        hits[0] += cell["accuracy"] * cell["n"]
        hits[1] += cell["n"]
    return seconds, sorted((p, b, n, round(h / n, 6)) for (p, b), (h, n) in pooled.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("qa", help="the QA file (tools/niah_qa.py)")
    parser.add_argument("--src", action="append", default=[], help="a source tree to run (repeat for a second arm)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--policies", default="snapkv,streamingllm,knorm,tova")
    parser.add_argument("--budgets", default="50%")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    arms = args.src or ["src"]
    times: dict[str, list[float]] = {src: [] for src in arms}
    cells = {}
    with tempfile.TemporaryDirectory() as out:
        for repeat in range(args.repeats):
            for n, src in enumerate(arms):
                seconds, cells[src] = run(src, args, out, f"qa-run-{n}-{repeat}")
                times[src].append(seconds)
                print(f"run {repeat} {src}: {seconds:.1f} s", flush=True)
    first = cells[arms[0]]
    assert all(c == first for c in cells.values()), f"the arms' cells differ: {cells}"
    print("cells (policy, budget, n, accuracy): " + "; ".join(f"{p} {b} {a:.2f} of {n}" for p, b, n, a in first))
    medians = {src: statistics.median(t) for src, t in times.items()}
    for src, median in medians.items():
        print(f"{src}: median {median:.1f} s of {len(times[src])} ({', '.join(f'{t:.1f}' for t in times[src])})")
    if len(arms) == 2:
        print(f"{arms[0]} takes {medians[arms[0]] / medians[arms[1]]:.2f}x the time of {arms[1]} (medians)")


if __name__ == "__main__":
    main()
