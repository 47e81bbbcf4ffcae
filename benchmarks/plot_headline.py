"""PPL along the stream for the headline runs, both position modes side by side.

    .venv/bin/python benchmarks/plot_headline.py docs/results/headline-20k-original.jsonl \\
        docs/results/headline-20k-cache.jsonl --out docs/img/headline-20k.png
"""

from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kvevict.records.schema import load, ppl_records  # noqa: E402
from kvevict.records.store import ResultStore  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("original")
    parser.add_argument("cache")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, path, mode in zip(axes, (args.original, args.cache), ("original positions", "cache positions (shifted)")):
        for record in ppl_records(load(ResultStore(path).records())):
            if record.kind == "oracle" or not record.curve:
                continue
            if record.kind == "policy" and record.label == "window":
                continue  # the same row as the sink sweep's window
            xs = [(w["start"] + w["end"]) / 2 for w in record.curve]
            ax.plot(xs, [w["ppl"] for w in record.curve], label=record.label)
        ax.set_yscale("log")
        ax.axvline(8192, color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"budget 1024, {mode}", fontsize=10)
        ax.set_xlabel("prediction (dotted: the model's 8,192-token trained context)")
    axes[0].set_ylabel("PPL per window of ~500 predictions (log)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
