"""`--json` on `envelope` and `ab`: one JSON object on the last line of stdout, holding what the tables show,
checked against the run's own records (and, for the capacity arithmetic, against a hand computation)."""

import json

from kvevict.records.schema import load, ppl_records
from kvevict.records.store import ResultStore
from kvevict.report.envelope import envelope_rows
from kvevict.report.verdict import verdict
from kvevict.report.verdict_text import sentence
from kvevict.stats.tolerance import Tolerance
from test_capacity import LLAMA3_8B

from support import cli

TEXT = "It was the best of times, it was the worst of times, it was the age of wisdom. " * 40


def _last(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_config_only_json_holds_the_sequences_that_fit():
    result = cli("envelope", "--config-only", LLAMA3_8B, "--deploy-context", "32768", "--accelerator-memory", "80GB",
                 "--weight-bytes", "16GB", "--configs", "full,window@4096", "--json")
    assert result.exit_code == 0, result.stderr
    rows = {r["name"]: r for r in _last(result.stdout)["capacity"]["rows"]}
    per_token = 32 * 8 * 128 * 2 * 2  # layers x KV heads x head_dim x (K, V) x bf16 bytes
    assert rows["full cache"]["sequence_bytes"] == per_token * 32768
    assert rows["window@4096"]["sequence_bytes"] == per_token * 4096
    assert rows["window@4096"]["sequences"] == (64 * 10**9) // (per_token * 4096)


def test_envelope_json_names_the_smallest_budget_found(tmp_path, tiny_dir):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    result = cli("envelope", "--model", str(tiny_dir), "--text", str(text), "--tokens", "96", "--policies",
                 "window,h2o", "--floor", "8", "--resolution", "1.5", "--max-ppl-ratio", "1.5",
                 "--out", str(tmp_path / "runs"), "--name", "j", "--json", env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.stderr
    (found,) = _last(result.stdout)["envelopes"]
    records = ppl_records(load(ResultStore(tmp_path / "runs" / "j" / "results.jsonl").records()))
    full, rows = envelope_rows(records, Tolerance(max_ppl_ratio=1.5))
    assert found["tokens"] == 96 and found["full_ppl"] == full.ppl
    assert [c["spec"] for c in found["configurations"]] == [r.spec for r in rows]
    for got, row in zip(found["configurations"], rows):
        assert (got["smallest"] or {}).get("budget") == (row.smallest.budget if row.smallest else None)
        assert got["probes"] == len(row.probes)
    assert found["report"].endswith("envelope.html")


def test_ab_json_holds_the_rows_and_the_verdict(tmp_path, tiny_dir):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    result = cli("ab", "--model", str(tiny_dir), "--text", str(text), "--tokens", "200", "--budgets", "16,48",
                 "--policies", "window,h2o", "--oracle-stride", "0", "--out", str(tmp_path / "runs"), "--name", "j",
                 "--json", env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.stderr
    got = _last(result.stdout)
    records = load(ResultStore(tmp_path / "runs" / "j" / "results.jsonl").records())
    assert {(r["policy"], r["budget"]): r["ppl"] for r in got["rows"]} == {
        (r.policy, r.budget): r.ppl for r in ppl_records(records)}
    expected = verdict(records, Tolerance())
    assert [(v["budget"], v["recommended"], v["sentence"]) for v in got["verdict"]] == [
        (v.budget, v.recommended.name if v.recommended else None, sentence(v)) for v in expected]
    assert got["tolerance"] == Tolerance().as_dict() and got["report"].endswith("report.html")
