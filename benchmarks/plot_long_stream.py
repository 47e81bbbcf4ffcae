"""Plot PPL per 1,000-prediction window of `long_stream.py --json` records, one line each.

    .venv/bin/python benchmarks/plot_long_stream.py docs/results/long-stream-*.json --out docs/img/long-stream.png
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("records", nargs="+")
    parser.add_argument("--out", required=True)
    parser.add_argument("--trained", type=int, default=8192, help="the model's trained context, drawn as a line")
    args = parser.parse_args()
    fig, ax = plt.subplots(figsize=(8, 4))
    for path in args.records:
        with open(path) as handle:
            record = json.load(handle)
        windows = record["windows_1000"]
        label = f"{record['policy']} {record['positions']} positions, budget {record['budget']}"
        ax.plot([w["end"] for w in windows], [w["ppl"] for w in windows], label=label)
    ax.axvline(args.trained, color="grey", linestyle=":", label=f"trained context ({args.trained})")
    ax.set_xlabel("token position")
    ax.set_ylabel("PPL per 1,000 predictions")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("A long stream under a bounded cache")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
