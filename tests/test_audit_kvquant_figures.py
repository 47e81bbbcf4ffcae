"""docs/audit.md's "llama.cpp's quantized KV" says what its record says
(`docs/results/audit-llamacpp-kvquant-smollm2.json`, written by `benchmarks/audit_kvquant.py`): each figure of the
table and the prose is read out of the doc and compared with the record's fields (intervals as recorded; pooled
top-1 disagreement and ratios recomputed from them). Editing either side alone fails here. No server runs.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from doc_records import INTERVAL, RESULTS, caught_when_changed, check, check_interval, doc, said, table

PATH = "docs/audit.md"
LIMIT = math.log(1.05)
#: the table's first column -> the record's row
ROWS = {"f16 (the twin)": "f16", "q8_0": "q8_0", "q8_0, `LLAMA_ATTN_ROT_DISABLE=1`": "q8_0 unrotated",
        "q4_0": "q4_0", "q4_0, `LLAMA_ATTN_ROT_DISABLE=1`": "q4_0 unrotated"}


def text() -> str:
    start = doc(PATH).index("## llama.cpp's quantized KV")
    return doc(PATH)[start:]


def record() -> dict:
    return json.loads((RESULTS / "audit-llamacpp-kvquant-smollm2.json").read_text())["rows"]


def pooled(row: dict, side: str, key: str) -> float:
    """A per-token mean over the prompts (each of the same length)."""
    return sum(p[side][key] for p in row["prompts"]) / len(row["prompts"])


def test_the_setup_is_the_records():
    offsets, prompt, generated, judged = said(text(), (
        r"two prompts of pg-essays \(text offsets ([\d and]+)\) of (\d+) tokens and (\d+) greedy tokens each "
        r"\(([\d,]+) judged tokens\)"))
    for name, row in record().items():
        assert [p["offset"] for p in row["prompts"]] == [int(x) for x in offsets.split(" and ")], name
        for p in row["prompts"]:
            deployed = p["outside"]["audit"]["deployed"]
            assert (deployed["prompt"], deployed["generated"]) == (int(prompt), int(generated)), name
            assert deployed["judge"] == "whole" and deployed["events"] == [] and deployed["floor_source"] == "twin"
            assert deployed["judgements"][0]["limit"] == pytest.approx(LIMIT)
        assert len(row["prompts"]) * int(generated) == int(judged.replace(",", "")), name


def test_every_row_of_the_table():
    data = record()
    rows = table(PATH, "| llama-server KV | kvevict's form")
    assert [r[0] for r in rows] == list(ROWS)
    base = data["f16"]["capacity"]["sequences_per_gib"]
    for label, form, outside, verdicts, inside, mib, sequences in rows:
        row = data[ROWS[label]]
        assert form.strip("`") == row["spec"], label
        check_interval(re.fullmatch(INTERVAL, outside).groups(), (row["outside_kl"], *row["outside_kl_interval"]),
                       f"{label}: outside KL")
        assert verdicts.split(", ") == [p["outside"]["outcome"] for p in row["prompts"]], label
        check_interval(re.fullmatch(INTERVAL, inside).groups(), (row["inside_kl"], *row["inside_kl_interval"]),
                       f"{label}: inside KL")
        logged, arithmetic = mib.split(" / ")
        c = row["capacity"]
        check(logged, c["logged_mib"], f"{label}: logged MiB")
        check(arithmetic, c["arithmetic_mib"], f"{label}: arithmetic MiB")
        count, ratio = re.fullmatch(r"(\d+) \((\d\.\d+)×\)", sequences).groups()
        assert int(count) == c["sequences_per_gib"] == 2**30 // c["arithmetic_bytes"], label
        check(ratio, c["sequences_per_gib"] / base, f"{label}: sequences against f16's")
        assert c["logged"]["k_type"] == c["logged"]["v_type"] == row["kv_type"], label


def test_what_the_findings_say():
    data = record()
    q8, times8, gain8, moved = said(text(), (
        r"\*\*`q8_0` is free\.\*\* (\d\.\d+) nats per token from outside, (\d+)× below the limit, for (\d\.\d+)× the "
        r"sequences of the default f16 cache\. No top-1 choice moved on the first prompt, (one) of 736 on the second"))
    check(q8, data["q8_0"]["outside_kl"], "q8_0's KL")
    check(times8, LIMIT / data["q8_0"]["outside_kl"], "q8_0 below the limit")
    check(gain8, data["q8_0"]["capacity"]["sequences_per_gib"] / data["f16"]["capacity"]["sequences_per_gib"], "q8_0")
    assert [round(p["outside"]["disagree"] * 736) for p in data["q8_0"]["prompts"]] == [0, 1]
    q4, times4, gain4 = said(text(), r"`q4_0` as llama\.cpp ships it is inside too\*\*: (\d\.\d+) nats, (\d+)× below "
                                     r"the limit, for (\d\.\d+)× the sequences")
    check(q4, data["q4_0"]["outside_kl"], "q4_0's KL")
    check(times4, LIMIT / data["q4_0"]["outside_kl"], "q4_0 below the limit")
    check(gain4, data["q4_0"]["capacity"]["sequences_per_gib"] / data["f16"]["capacity"]["sequences_per_gib"], "q4_0")
    more, plain, share = said(text(), r"`q4_0` costs (\d+)× more, (\d\.\d+) nats, at the limit: .*? (\d\.\d+)% of the "
                                      r"top-1 choices changed")
    check(more, data["q4_0 unrotated"]["outside_kl"] / data["q4_0"]["outside_kl"], "the rotation's gain")
    check(plain, data["q4_0 unrotated"]["outside_kl"], "unrotated q4_0's KL")
    check(share, 100 * pooled(data["q4_0 unrotated"], "outside", "disagree"), "unrotated q4_0's top-1 changes")
    server, form = said(text(), r"At `q8_0` they do not: the server loses (\d\.\d+) nats a token against the "
                                r"form's\s+(\d\.\d+)")
    check(server, data["q8_0"]["outside_kl"], "q8_0 outside")
    check(form, data["q8_0"]["inside_kl"], "q8_0 inside")


def test_every_row_agrees_within_the_reproductions_tolerance():
    """What the findings claim of inside against outside, by `Reproduction.agrees` on the recorded means. The f16 row
    is left out, as the doc says: outside it is the twin against itself (0 exactly), inside f16 against float32."""
    from kvevict.audit.reproduction import Reproduction

    data = record()
    assert data["f16"]["outside_kl"] == 0.0 and 0 < data["f16"]["inside_kl"] < 1e-7
    (written,) = said(text(), r"inside, `f16\+full` against float32, (\de-\d)\.\)")
    assert float(written) == pytest.approx(round(data["f16"]["inside_kl"], 8)), "f16 inside"
    agreeing = {}
    for name, row in data.items():
        if name == "f16":
            continue
        found = Reproduction(spec=name, shifts_audit=(), shifts_kvevict=(),
                             disagree_audit=pooled(row, "outside", "disagree"),
                             disagree_kvevict=pooled(row, "inside", "disagree"), kl_audit=row["outside_kl"],
                             kl_kvevict=row["inside_kl"], floor_disagree=0.0)
        agreeing[name] = found.agrees()
    assert agreeing == {"q8_0": False, "q8_0 unrotated": False, "q4_0": True, "q4_0 unrotated": True}, agreeing
    assert "inside and outside agree at `q4_0`" in text()
    assert "At `q8_0` they do not" in text()

def test_the_logged_bytes_are_the_arithmetic():
    for name, row in record().items():
        c = row["capacity"]
        halves = c["arithmetic_mib"] / 2
        assert c["logged"]["k_mib"] == pytest.approx(halves, abs=0.005) == c["logged"]["v_mib"], name


CHANGED = [
    (test_every_row_of_the_table, "0.00430 [0.00260, 0.00633]", "0.00430 [0.00260, 0.00634]"),
    (test_every_row_of_the_table, "| 85 (1.89×) |", "| 86 (1.89×) |"),
    (test_every_row_of_the_table, "undecided, inside", "inside, inside"),
    (test_what_the_findings_say, "2.65% of the top-1", "2.66% of the top-1"),
    (test_what_the_findings_say, "152× below the limit", "150× below the limit"),
]


test_a_changed_figure_fails_its_check = caught_when_changed(PATH, CHANGED)
