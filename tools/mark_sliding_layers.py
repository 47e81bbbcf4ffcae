"""Bring a results.jsonl written before sink loss counted only bounded layers up to date.

Rows of `sink_lost_at` for a model's own sliding-window layers become null and the
record notes the window, so every table and the verdict count only the layers the
budget bounds (see `kvevict.eval.sink_loss`). Usage:

    python tools/mark_sliding_layers.py docs/results/claims-gemma3-270m.jsonl --full 5,11,17 --window 512

(Gemma 3 270M: layers 5, 11 and 17 are its full-attention layers, the other 15 slide over 512 tokens.)
Lines are rewritten in place; nothing else changes. Running it twice changes nothing more.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--full", required=True, help="indices of the full-attention layers, e.g. 5,11,17")
    parser.add_argument("--window", type=int, required=True, help="the sliding layers' window")
    args = parser.parse_args()
    full = {int(i) for i in args.full.split(",")}
    lines = []
    for text in args.results.read_text().splitlines():
        data = json.loads(text)
        grid = data.get("sink_lost_at")
        if grid:
            data["sink_lost_at"] = [row if i in full else None for i, row in enumerate(grid)]
            data["sliding_window"] = args.window
        lines.append(json.dumps(data, sort_keys=True))
    args.results.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
