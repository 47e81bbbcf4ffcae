"""First question against the later ones, per `multi` form, policy and budget of one task.

docs/results.md compares `multi --form requests` with `--form aware-requests`: whether the
first question, when it chose what the context kept, cost the later questions their keys.
The report pools a cell's questions; this splits them, from the run's records:

    python3 tools/multi_split.py runs/ruler-smollm2-2k niah_multikey_1 2000
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def split(records: list[dict], task: str, length: int) -> dict[tuple[str, str, str], list[float]]:
    """(form, budget, policy) -> [first hits, first answers, later hits, later answers]."""
    cells: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0.0, 0, 0.0, 0])
    for r in records:
        if r.get("kind") != "ruler" or r.get("protocol") != "multi" or r["task"] != task or r["length"] != length:
            continue
        cell = cells[(r["form"], r["budget"], r["policy"])]
        later = 2 if r["question"] else 0
        cell[later] += r["score"]
        cell[later + 1] += 1
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a run folder (holding results.jsonl)")
    parser.add_argument("task")
    parser.add_argument("length", type=int)
    args = parser.parse_args()
    lines = (args.run / "results.jsonl").read_text().splitlines()
    cells = split([json.loads(line) for line in lines if line.strip()], args.task, args.length)
    print("| form | budget | policy | first question | later questions |")
    print("|---|---|---|---|---|")
    for (form, budget, policy), (h0, n0, h1, n1) in sorted(cells.items()):
        print(f"| {form} | {budget} | {policy} | {h0:g}/{n0} | {h1:g}/{n1} |")


if __name__ == "__main__":
    main()
