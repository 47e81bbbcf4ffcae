"""PPL of one row over another's in a run folder, with the paired 95% block-bootstrap interval.

The report gives each policy's PPL against the full cache. Where the full cache is not
the reference one wants (a 20,000-token stream runs SmolLM2 past its trained positions,
so its full cache scores worse than every bounded policy), a team asks instead what one
setting costs against another: llama.cpp's default against Ollama's, say (`--also`: rows
of another run of the same stream, in another position mode). Same blocks,
same resampling as the report (`stats/uncertainty.py`), the ratio exp(mean NLL a - b).

    .venv/bin/python benchmarks/paired_ratio.py runs/engines-smollm2-20k-cache \
        'llamacpp:keep=0,bos=0' 'ollama:keep=4,bos=0'
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from kvevict.records.schema import load, ppl_records
from kvevict.records.store import ResultStore
from kvevict.stats.uncertainty import blocks, paired_difference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", help="a run folder holding results.jsonl")
    parser.add_argument("pairs", nargs="+", help="policy names as the records spell them: a b [a b ...]")
    parser.add_argument("--also", action="append", default=[],
                        help="another run folder of the same stream whose rows join these (another position mode)")
    args = parser.parse_args()
    if len(args.pairs) % 2:
        parser.error("give the policies in pairs: a b [a b ...]")
    rows = {}
    for folder in [args.run, *args.also]:
        for record in ppl_records(load(ResultStore(Path(folder) / "results.jsonl").records())):
            if record.curve:
                rows.setdefault(record.policy, record)  # the full cache of the first folder
    print("| a | b | PPL a | PPL b | PPL a / PPL b [paired 95%] |")
    print("|---|---|---|---|---|")
    for a, b in zip(args.pairs[::2], args.pairs[1::2], strict=True):
        missing = [name for name in (a, b) if name not in rows]
        if missing:
            raise SystemExit(f"no row named {', '.join(missing)} in {args.run}: the rows are {', '.join(rows)}")
        found = paired_difference(blocks(rows[a].curve, "ppl"), blocks(rows[b].curve, "ppl"))
        ratio = rows[a].ppl / rows[b].ppl
        interval = "no paired interval" if found is None else f"[{math.exp(found.low):.3f}, {math.exp(found.high):.3f}]"
        print(f"| {a} | {b} | {rows[a].ppl:.2f} | {rows[b].ppl:.2f} | {ratio:.3f} {interval} |")


if __name__ == "__main__":
    main()
