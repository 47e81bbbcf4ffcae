"""`kvevict ruler` end to end on a tiny model: records per answer, resume, the report, bad input.

The report's numbers (intervals, the beyond-the-model mark, the rank correlation) are
checked against values computed by hand.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvevict.cli import app
from kvevict.records.schema import PplRecord, RulerRecord
from kvevict.report import ruler as ruler_report

runner = CliRunner()


def _invoke(*args: str):
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def _args(tiny_dir, out, *extra):
    return ["ruler", "--model", str(tiny_dir), "--tasks", "niah_single_1,niah_multikey_2", "--lengths", "400",
            "--samples", "2", "--policies", "window,h2o", "--budgets", "50%", "--max-new-tokens", "3",
            "--out", str(out), "--name", "r", *extra]


@pytest.mark.parametrize("protocol", ["agnostic", "stream"])
def test_an_engine_preset_runs_in_the_positions_its_engine_decides(protocol, tiny_pair):
    """llama.cpp's shift renumbers positions within the cache: the grid runs it with `positions='cache'` (its
    kept set is llama.cpp's: the head it keeps and the newest tokens) and refuses it with `original`."""
    from kvevict.errors import KvevictError
    from kvevict.eval.ruler.grid import RulerGrid, run_grid

    model, tokenizer = tiny_pair
    grid = RulerGrid(tasks=["niah_single_1"], lengths=[900], samples=1, policies=["llamacpp:keep=4"],
                     budgets=["25%"], protocol=protocol, positions="cache", max_new_tokens=2)
    full, preset = run_grid(model, tokenizer, grid)
    assert (full["policy"], preset["policy"]) == ("full", "llamacpp:keep=4,bos=0")  # SmolLM2's vocabulary: no BOS
    budget = preset["budget_tokens"]  # the engine's context: the most it ever holds
    assert budget == round(preset["context_tokens"] / 4) and preset["kept"] <= budget
    with pytest.raises(KvevictError, match="the engine decides positions"):
        run_grid(model, tokenizer, RulerGrid(tasks=["niah_single_1"], lengths=[900], samples=1,
                                             policies=["llamacpp:keep=4"], budgets=["25%"], protocol=protocol))


def test_ruler_records_every_answer_and_resumes_only_what_is_missing(tmp_path, tiny_dir):
    code, stdout, stderr = _invoke(*_args(tiny_dir, tmp_path))
    assert code == 0, stderr
    results = tmp_path / "r" / "results.jsonl"
    lines = results.read_text().splitlines()
    # 2 tasks x 2 samples x (the full cache + 2 policies)
    records = [json.loads(line) for line in lines]
    assert len(records) == 12 and len({r["key"] for r in records}) == 12
    assert {r["kind"] for r in records} == {"ruler"} and {r["protocol"] for r in records} == {"agnostic"}
    assert {r["policy"] for r in records} == {"full", "window", "h2o"}
    assert all(r["budget_tokens"] == round(r["context_tokens"] / 2) for r in records if r["policy"] != "full")
    assert "RULER tasks" in (tmp_path / "r" / "report.html").read_text()
    assert "At budget 50% " in stdout  # the verdict of a run of tasks alone, printed as the report shows it
    # a rerun answers nothing again
    assert _invoke(*_args(tiny_dir, tmp_path))[0] == 0
    assert results.read_text().splitlines() == lines
    # a run killed after 7 answers: the rerun adds exactly the 5 missing ones, the 7 kept as they were
    results.write_text("\n".join(lines[:7]) + "\n")
    assert _invoke(*_args(tiny_dir, tmp_path))[0] == 0
    again = results.read_text().splitlines()

    def answers(rows):
        return sorted((r["key"], r["output"], r["score"]) for r in map(json.loads, rows))

    assert again[:7] == lines[:7] and answers(again) == answers(lines)
    # answers cut at another length are another experiment: refused, the records untouched
    code, _, stderr = _invoke(*_args(tiny_dir, tmp_path, "--max-new-tokens", "4"))  # the last one given counts
    assert code == 2 and "use another --name" in stderr and results.read_text().splitlines() == again
    # another protocol adds to the same folder, under its own keys
    code, _, stderr = _invoke(*_args(tiny_dir, tmp_path, "--protocol", "multi", "--tasks", "niah_multikey_2",
                                     "--samples", "1", "--form", "turns"))
    assert code == 0, stderr
    multi = [json.loads(x) for x in results.read_text().splitlines()[12:]]
    assert len(multi) == 3 * 4 and {r["form"] for r in multi} == {"turns"}  # 3 rows x 4 questions


def test_a_rerun_adding_a_budget_to_kvzip_reads_each_contexts_scores_back(tmp_path, tiny_dir, monkeypatch):
    """KVzip's scores are kept in the run folder (`reconstruction/`): a rerun that adds a budget answers it from a
    prefill scored by what the first run's repeat forwards left, and runs none of them again."""
    from support import count_repeat_forwards

    passes = count_repeat_forwards(monkeypatch)
    args = ["ruler", "--model", str(tiny_dir), "--tasks", "niah_single_1", "--lengths", "400", "--samples", "2",
            "--policies", "kvzip", "--max-new-tokens", "3", "--out", str(tmp_path), "--name", "r", "--budgets"]
    assert _invoke(*args, "50%")[0] == 0
    assert len(passes) == 2 and len(list((tmp_path / "r" / "reconstruction").glob("*.pt"))) == 2
    assert _invoke(*args, "50%,25%")[0] == 0
    assert len(passes) == 2
    records = [json.loads(line) for line in (tmp_path / "r" / "results.jsonl").read_text().splitlines()]
    assert sorted(r["budget"] for r in records if r["policy"] != "full") == ["25%", "25%", "50%", "50%"]


def test_ruler_on_a_qa_file(tmp_path, tiny_dir):
    qa = tmp_path / "qa.jsonl"
    qa.write_text("\n".join(json.dumps({"context": f"Document {i}: the code word is tulip{i}.",
                                        "question": "What is the code word?", "answers": [f"tulip{i}"]})
                            for i in range(3)) + "\n")
    code, _, stderr = _invoke("ruler", "--model", str(tiny_dir), "--qa", str(qa), "--samples", "2",
                              "--policies", "window", "--budgets", "50%", "--max-new-tokens", "2",
                              "--out", str(tmp_path), "--name", "qa")
    assert code == 0, stderr
    records = [json.loads(x) for x in (tmp_path / "qa" / "results.jsonl").read_text().splitlines()]
    assert len(records) == 4 and {r["metric"] for r in records} == {"part"}
    assert {tuple(r["answers"]) for r in records} == {("tulip0",), ("tulip1",)}


@pytest.mark.parametrize("extra, says", [
    (["--tasks", "niah_single_9"], "unknown RULER task 'niah_single_9'"),
    (["--samples", "0"], "--samples must be at least 1"),
    (["--budgets", "100%"], "that is the full cache"),
    (["--budgets", "400"], "keeps the whole context, which is the full cache"),
    (["--protocol", "aware"], "aware is meaningless for 'window'"),
    (["--protocol", "multi"], "protocol multi needs several keys"),
    (["--protocol", "multi", "--form", "aware-requests", "--tasks", "niah_multikey_1"],
     "protocol multi --form aware-requests is meaningless for 'window'"),
    (["--protocol", "multi", "--form", "sideways", "--tasks", "niah_multikey_1"], "unknown multi form 'sideways'"),
    (["--lengths", "9000"], "more than the model's context of 8192: use lengths up to 8192"),
    (["--max-new-tokens", "-2"], "--max-new-tokens must be 0 (RULER's answer length) or positive, got -2"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, tiny_dir, extra, says):
    code, _, stderr = _invoke(*_args(tiny_dir, tmp_path, *extra))
    assert code == 2, stderr
    assert says in stderr and len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr


def test_bad_qa_file_is_one_line_and_exit_2(tmp_path, tiny_dir):
    qa = tmp_path / "qa.jsonl"
    qa.write_text('{"context": "c", "question": "q", "answers": []}\n')
    code, _, stderr = _invoke("ruler", "--model", str(tiny_dir), "--qa", str(qa), "--out", str(tmp_path))
    assert code == 2 and "qa.jsonl:1 has an empty answer list" in stderr
    qa.write_text('{"context": "c", "answers": ["a"]}\n')
    code, _, stderr = _invoke("ruler", "--model", str(tiny_dir), "--qa", str(qa), "--out", str(tmp_path))
    assert code == 2 and "lacks 'question'" in stderr


def _record(policy, budget, score, sample, task="niah_single_1"):
    return RulerRecord(f"{policy}{budget}{sample}{task}", task, "agnostic", 1000, sample, policy, budget, score)


def test_cells_intervals_and_the_beyond_mark():
    records = [_record("full", "full", s, i) for i, s in enumerate([1, 1, 1, 0])]
    records += [_record("h2o", "50%", s, i) for i, s in enumerate([1, 0, 0, 0])]
    records += [_record("full", "full", s, i, "vt") for i, s in enumerate([1, 0, 0.5, 0])]
    found = {(c.task, c.policy): c for c in ruler_report.cells(records)}
    h2o = found[("niah_single_1", "h2o")]
    assert (h2o.n, h2o.accuracy) == (4, 0.25)
    # Wilson 95% of 1/4, by hand: centre (0.25 + 1.92/4) / 1.96, half 1.96 sqrt(0.1875/4 + 0.9604/16) / 1.96
    assert h2o.low == pytest.approx(0.0456, abs=1e-4) and h2o.high == pytest.approx(0.6994, abs=1e-4)
    assert not h2o.beyond and found[("vt", "full")].beyond  # vt's full cache: 1.5/4 < 50%


def test_a_row_whose_cells_hold_different_counts_says_each_count():
    # a policy added to a run later has answered fewer samples than the full cache: its row must not show one n
    records = [_record("full", "full", 1, i) for i in range(10)] + [_record("h2o", "50%", 1, i) for i in range(10)]
    records += [_record("tova", "50%", 0, i) for i in range(5)]
    [row] = ruler_report.ruler_table(ruler_report.cells(records)).rows
    assert row[3] == "5–10"
    assert row[4].endswith("n=10") and row[5].endswith("n=10") and row[6].endswith("n=5")
    same = [_record("full", "full", 1, i) for i in range(5)] + [_record("h2o", "50%", 0, i) for i in range(5)]
    [row] = ruler_report.ruler_table(ruler_report.cells(same)).rows
    assert row[3] == "5" and "n=" not in row[4] + row[5]


def test_rank_correlation_between_perplexity_and_tasks():
    ppl = [PplRecord(f"p{p}", "policy", p, 64, value) for p, value in
           [("window", 30.0), ("h2o", 20.0), ("snapkv", 25.0)]]
    records = []
    for policy, scores in [("window", [0, 0]), ("h2o", [1, 0]), ("snapkv", [1, 1])]:
        records += [_record(policy, "64", s, i) for i, s in enumerate(scores)]
    records += [_record("full", "full", 1, i) for i in range(2)]
    [row] = ruler_report.rank_agreement(ppl, records)
    # -PPL ranks window 1, snapkv 2, h2o 3; accuracy ranks window 1, h2o 2, snapkv 3: d = (0, 1, 1), rho = 1 - 6*2/24
    assert row["rho"] == pytest.approx(0.5)
    assert ruler_report.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)


def test_ab_runs_ruler_tasks_in_the_same_run_and_report(tmp_path, tiny_dir):
    from dataclasses import asdict

    from kvevict.ab import SweepConfig
    from kvevict.ab.run import run_sweep
    from kvevict.loading import load_model
    from kvevict.report.html import render

    model, tokenizer = load_model(str(tiny_dir))
    cfg = SweepConfig(tokens=300, budgets=[32], policies=["streamingllm", "h2o"], oracle_stride=50,
                      out=str(tmp_path / "runs"), name="ab", ruler=["niah_single_1"], ruler_length=400,
                      ruler_samples=2)
    store, records = run_sweep(cfg, model=model, tokenizer=tokenizer, progress=False)
    answers = [r for r in records if r.kind == "ruler"]
    assert len(answers) == 2 * 3 and {r.budget for r in answers} == {"full", "32"}
    assert {r.name for r in records if r.kind == "policy"} == {r.policy for r in answers} - {"full"}
    page = render(records, asdict(cfg), tmp_path / "report.html").read_text()
    assert 'id="ruler"' in page and 'id="summary"' in page
    # a random tiny model fails every task with the full cache: beyond it, so no ranking is drawn from them
    assert "No rank correlation with perplexity" in page and "†" in page
    before = store.path.read_text()
    run_sweep(cfg, model=model, tokenizer=tokenizer, progress=False)  # finished: nothing again
    assert store.path.read_text() == before


@pytest.fixture(scope="module")
def tiny_pair(tiny_dir):
    from kvevict.loading import load_model

    return load_model(str(tiny_dir))


@pytest.mark.parametrize("task", ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1",
                                  "niah_multikey_2", "niah_multikey_3", "niah_multivalue", "niah_multiquery",
                                  "vt", "cwe", "fwe"])
def test_every_task_runs_on_the_tiny_model(task, tiny_pair):
    from kvevict.eval.ruler.grid import RulerGrid, run_grid

    model, tokenizer = tiny_pair
    grid = RulerGrid(tasks=[task], lengths=[900], samples=1, policies=["streamingllm", "h2o"], budgets=["25%"],
                     max_new_tokens=2)
    records = run_grid(model, tokenizer, grid)
    assert [r["policy"] for r in records] == ["full", "streamingllm", "h2o"]
    for r in records:
        assert r["prompt_tokens"] + {"vt": 30, "cwe": 120, "fwe": 50}.get(task, 128) <= 900
        found = sum(a.lower() in r["output"].strip().lower() for a in r["answers"]) / len(r["answers"])
        assert r["score"] == found and r["budget_tokens"] in (None, round(r["context_tokens"] / 4))


def test_each_answer_records_the_kv_bytes_its_cache_held(tiny_pair):
    """A record's bytes are what the cache held once the context was compressed, checked against the model's shape:
    the tiny Llama holds 2 layers x 2 KV heads x head_dim 16, keys and values, 4 bytes each (float32) per token. At
    8 bits a key or value is 16 one-byte codes plus a float scale and zero point per group of 8 channels. At bf16
    every float counts 2 bytes."""
    from kvevict.eval.ruler.grid import RulerGrid, run_grid

    model, tokenizer = tiny_pair
    grid = RulerGrid(tasks=["niah_single_1"], lengths=[400], samples=1, policies=["window", "h2o", "q8:group=8+h2o"],
                     budgets=["50%"], max_new_tokens=2)  # window and h2o: one batch of two rows
    found = {r["policy"]: r for r in run_grid(model, tokenizer, grid)}
    layers, heads, dim = 2, 2, 16

    def dense(tokens: int, number: int) -> int:
        return layers * heads * tokens * 2 * dim * number

    full, h2o, q8 = found["full"], found["h2o"], found["q8:group=8+h2o"]
    assert full["kv_bytes"] == dense(full["context_tokens"], 4)
    assert full["kv_bytes_bf16"] == dense(full["context_tokens"], 2)
    assert h2o["kept"] == h2o["budget_tokens"] == q8["kept"]
    assert h2o["kv_bytes"] == found["window"]["kv_bytes"] == dense(h2o["budget_tokens"], 4)  # one row's, not two
    per_entry = {number: 2 * (dim + 2 * (dim // 8) * number) for number in (4, 2)}  # key and value
    assert q8["kv_bytes"] == layers * heads * q8["budget_tokens"] * per_entry[4]
    assert q8["kv_bytes_bf16"] == layers * heads * q8["budget_tokens"] * per_entry[2]
    found = ruler_report.cells([RulerRecord.from_dict(r) for r in found.values()])
    table = ruler_report.bytes_table(found)
    column = table.headers.index("q8:group=8+h2o")
    assert table.rows[0][column] == f"{q8['kv_bytes_bf16'] / 2**20:.4g}"
