"""A QA file of RULER niah_single_1 prompts, made by kvevict's own generator, for `kvevict ruler --qa`.

Each line is one niah_single_1 sample (`eval/ruler/grid.prompts`: noise haystack, one needle at a spread
depth, seed 0) fitted to `--length` tokens in the model's tokenizer, written as a QA row: the task's
instruction and haystack as `context`, its question as `question`, the needle's value as `answers` and its
answer prefix as `answer_prefix`. The QA template adds its own instruction, so a line of a 2,000-token
sample reads as about 1.9K prompt tokens. The file times the QA run (benchmarks/ruler_qa_run.py):

    PYTHONPATH=src python tools/niah_qa.py --samples 20 --length 2000 --out runs/niah-qa-2k.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvevict.eval.ruler.grid import RulerGrid, prompts
from kvevict.loading.models import load_tokenizer


def rows(model: str, samples: int, length: int, seed: int) -> list[dict]:
    """The QA rows of the first `samples` niah_single_1 samples at `length` tokens."""
    grid = RulerGrid(tasks=["niah_single_1"], lengths=[length], samples=samples, seed=seed)
    out = []
    for prompt in prompts(grid, load_tokenizer(model), None):
        sample = prompt.sample
        out.append({"context": sample.head, "question": sample.question.text.strip(),
                    "answers": list(sample.question.answers), "answer_prefix": sample.question.answer_prefix})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--length", type=int, default=2000, help="RULER's target length of each sample")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/niah-qa-2k.jsonl"))
    args = parser.parse_args()
    lines = rows(args.model, args.samples, args.length, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    print(f"{len(lines)} lines -> {args.out}")


if __name__ == "__main__":
    main()
