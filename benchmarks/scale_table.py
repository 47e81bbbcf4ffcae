"""The scale benchmark's records as the tables docs/benchmarks.md shows: one row per stream or compression.

`scale.py --json FILE` appends one JSON object per length read (a stream) or per compression. This reads
those files and prints Markdown, so every figure in the document is the record's, computed here once:

* a stream's seconds per 1K tokens at each length read, its **growth** (the longest length's over the
  shortest's; the target is within 10%), the SDPA baseline's range, the **ratio** range over the lengths
  (each length's ratio is measured beside the baseline in the same forwards, so their spread is a run's
  noise), its peak memory (the highest of its rows: each row holds the peak up to its length) against
  its bound, and how it was read (chunks or token by token, and its prefill's pieces);
* a compression's seconds, seconds per 1K, peak and bound.

    PYTHONPATH=benchmarks .venv/bin/python benchmarks/scale_table.py docs/results/scale-streams-cpu.ndjson \\
        docs/results/scale-compress-cpu.ndjson
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

#: the growth a stream's seconds per 1K may show from its shortest length to its longest
FLAT = 0.10


def load(paths: list[str]) -> list[dict]:
    """Every row of every record, in file order (a torn last line is skipped, as `scale.py` does on resume)."""
    rows = []
    for path in paths:
        for text in Path(path).read_text().splitlines():
            try:
                rows.append(json.loads(text))
            except json.JSONDecodeError:
                continue
    return rows


def span(values: list[float], form: str) -> str:
    """`lo–hi` in `form`, one value where they round alike."""
    lo, hi = form.format(min(values)), form.format(max(values))
    return lo if lo == hi else f"{lo}–{hi}"


def streams(rows: list[dict]) -> list[str]:
    """The stream table: one line per (shape, policy), the lengths as columns."""
    found: dict[tuple[str, str], dict[int, dict]] = {}
    for row in rows:
        if row.get("part") == "stream":
            found.setdefault((row["model"], row["policy"]), {})[row["tokens"]] = row
    lengths = sorted({n for by_length in found.values() for n in by_length})
    head = ["shape", "policy", *(f"s per 1K at {n // 1024}K" for n in lengths), "growth", "SDPA s per 1K",
            "kvevict / SDPA", "peak MB", "bound MB", "read", "prefill"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (model, policy), by_length in found.items():
        read = [by_length[n] for n in sorted(by_length)]
        growth = read[-1]["s_per_1k"] / read[0]["s_per_1k"]
        flat = "" if len(read) < 2 else f"×{growth:.2f}" + ("" if abs(growth - 1) <= FLAT else " (outside 10%)")
        cells = [model, f"`{policy}`", *(f"{by_length[n]['s_per_1k']:.3f}" if n in by_length else "" for n in lengths),
                 flat, span([r["sdpa_s_per_1k"] for r in read], "{:.3f}"),
                 span([r["ratio"] for r in read], "{:.2f}") + "×", f"{max(r['peak_rss_mb'] for r in read):.0f}",
                 f"{read[-1]['bound_mb']:.0f}", read[-1]["read"], read[-1].get("prefill", "one forward")]
        out.append("| " + " | ".join(cells) + " |")
    return out


def compressions(rows: list[dict]) -> list[str]:
    """The compression table: one line per (policy, context length, prefill)."""
    head = ["shape", "policy", "context", "prefill", "seconds", "s per 1K", "peak MB", "bound MB"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        if row.get("part") == "compress":
            policy = row["policy"].removesuffix(" (one forward)")
            out.append(f"| {row['model']} | `{policy}` | {row['length']:,} | {row['read']} | {row['seconds']:.1f} | "
                       f"{row['s_per_1k']:.3f} | {row['peak_rss_mb']:.0f} | {row['bound_mb']:.0f} |")
    return out


def main(argv: list[str] | None = None) -> None:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        raise SystemExit("usage: scale_table.py RECORD.ndjson [...]: the files scale.py --json wrote")
    rows = load(paths)
    for table in (streams(rows), compressions(rows)):
        if len(table) > 2:
            print("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
