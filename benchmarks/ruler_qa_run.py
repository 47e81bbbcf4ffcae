"""The QA run's wall time: `kvevict ruler --qa FILE` on the embedded model, timed in-process.

The command a user runs on a QA file of 20 niah_single_1 prompts of about 1.9K SmolLM2 tokens
(tools/niah_qa.py writes it), the full cache and four policies at half the context:

    kvevict ruler --qa FILE --samples 20 --protocol agnostic --policies snapkv,streamingllm,knorm,tova \\
        --budgets 50%

It runs in a fresh run folder (a folder that holds answers would resume, answering nothing), the
model load and the report included, with the command's own imports made before the clock starts.
Prints the seconds and the cells' accuracies; `--repeats N` runs it N times in a row. A revision
is compared by running this script with that revision's `src` first on the path.

    PYTHONPATH=src .venv/bin/python tools/niah_qa.py --out runs/niah-qa-2k.jsonl
    OMP_NUM_THREADS=2 PYTHONPATH=src .venv/bin/python benchmarks/ruler_qa_run.py runs/niah-qa-2k.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
import time

from kvevict.cli import main as kvevict


def run(qa: str, samples: int, policies: str, budgets: str, out: str, name: str) -> tuple[float, list[dict]]:
    """Seconds the command takes, and its cells (`--json`'s last line)."""
    argv = ["ruler", "--qa", qa, "--samples", str(samples), "--protocol", "agnostic", "--policies", policies,
            "--budgets", budgets, "--out", out, "--name", name, "--json"]
    printed = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(printed):
        try:
            kvevict(argv)
        except SystemExit as done:
            if done.code:
                raise
    seconds = time.perf_counter() - t0
    return seconds, json.loads(printed.getvalue().strip().splitlines()[-1])["cells"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("qa", help="the QA file (tools/niah_qa.py)")
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--policies", default="snapkv,streamingllm,knorm,tova")
    parser.add_argument("--budgets", default="50%")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    import torch  # noqa: F401 - the command's own imports, made before the clock starts
    import transformers  # noqa: F401

    with tempfile.TemporaryDirectory() as out:
        for repeat in range(args.repeats):
            seconds, cells = run(args.qa, args.samples, args.policies, args.budgets, out, f"qa-run-{repeat}")
            accuracies = ", ".join(f"{c['policy']} {c['budget']}: {c['accuracy']:.2f} of {c['n']}" for c in cells)
            print(f"run {repeat}: {seconds:.1f} s ({accuracies})", flush=True)


if __name__ == "__main__":
    main()
