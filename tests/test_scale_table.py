"""`benchmarks/scale_table.py` prints what the scale records hold: growth, ranges and peaks worked out here by hand.

Rows are written the way `scale.py --json` writes them (one per length read, each holding the peak up to its
length), one line torn as an interrupted run leaves it.
"""

from __future__ import annotations

import json
from importlib.util import module_from_spec, spec_from_file_location
from pathlib import Path

_SPEC = spec_from_file_location("scale_table", Path(__file__).resolve().parents[1] / "benchmarks" / "scale_table.py")
scale_table = module_from_spec(_SPEC)
_SPEC.loader.exec_module(scale_table)


def stream_row(policy: str, tokens: int, own: float, base: float, peak: float, **extra) -> dict:
    return {"part": "stream", "model": "llama-3.1-8b", "policy": policy, "tokens": tokens, "s_per_1k": own,
            "sdpa_s_per_1k": base, "ratio": own / base, "peak_rss_mb": peak, "bound_mb": 792.0,
            "read": "chunks of 256", **extra}


def written(tmp_path: Path, rows: list[dict]) -> str:
    path = tmp_path / "scale.ndjson"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"part": "stream", "mod')
    return str(path)


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip("|").split("|")]


def test_a_stream_line_shows_its_lengths_growth_ranges_and_highest_peak(tmp_path):
    rows = [stream_row("h2o", 8192, 1.50, 1.00, 560.0, prefill="pieces of 256"),
            stream_row("h2o", 32768, 1.60, 0.98, 575.0, prefill="pieces of 256"),
            stream_row("h2o", 131072, 1.80, 1.02, 570.0, prefill="pieces of 256"),
            stream_row("window", 8192, 0.95, 1.00, 550.0), stream_row("window", 32768, 0.97, 1.01, 551.0)]
    table = scale_table.streams(scale_table.load([written(tmp_path, rows)]))
    assert len(table) == 4  # header, rule, two streams; the torn line is skipped
    h2o, window = cells(table[2]), cells(table[3])
    assert h2o[:5] == ["llama-3.1-8b", "`h2o`", "1.500", "1.600", "1.800"]
    assert h2o[5] == f"×{1.80 / 1.50:.2f} (outside 10%)"  # 1.20: more than 10% dearer at 128K
    assert h2o[6] == "0.980–1.020"
    assert h2o[7] == f"{min(1.5 / 1.0, 1.6 / 0.98, 1.8 / 1.02):.2f}–{max(1.5 / 1.0, 1.6 / 0.98, 1.8 / 1.02):.2f}×"
    assert h2o[8] == "575"  # the highest row, not the last
    assert h2o[10:] == ["chunks of 256", "pieces of 256"]
    assert window[4] == "" and window[5] == f"×{0.97 / 0.95:.2f}"  # no 128K row; within 10%
    assert window[11] == "one forward"  # a record from before the prefill was read in pieces


def test_a_compression_line_reads_its_seconds(tmp_path):
    row = {"part": "compress", "model": "llama-3.1-8b", "policy": "snapkv (one forward)", "length": 32768,
           "tokens": 32768, "s_per_1k": 1.5, "seconds": 49.2, "read": "one forward", "peak_rss_mb": 3382.4,
           "bound_mb": 17088.0}
    table = scale_table.compressions(scale_table.load([written(tmp_path, [row])]))
    assert cells(table[2]) == ["llama-3.1-8b", "`snapkv`", "32,768", "one forward", "49.2", "1.500", "3382", "17088"]


def test_the_scale_tables_of_the_benchmarks_doc_are_the_records():
    """docs/benchmarks.md shows the scale records through this script: a figure edited in the doc or a record
    rerun without the doc fails here."""
    from doc_records import headed_table

    results = Path(__file__).resolve().parents[1] / "docs" / "results"
    for after, record, make in (("Streams (records:", "scale-streams-cpu.ndjson", scale_table.streams),
                                ("Compression (records:", "scale-compress-cpu.ndjson", scale_table.compressions)):
        expected = make(scale_table.load([str(results / record)]))
        head, body = headed_table("docs/benchmarks.md", after)
        assert head == cells(expected[0]), after
        assert body == [cells(line) for line in expected[2:]], after
