"""`kvevict envelope --tasks`: sequential sampling and the bisection on task cells.

The search is checked on a known oracle (answers scored by a rule the test states, in place of
the model), against a brute-force grid of every budget judged at the cap; then once on a tiny
model through the real grid runner, for records and resume.
"""

from __future__ import annotations

import pytest

from kvevict.ab import task_envelope
from kvevict.ab.task_envelope import TaskEnvelopeConfig, run_task_envelope
from kvevict.eval.ruler.grid import record_key
from kvevict.policies.budget import budget_label
from kvevict.report.task_envelope import at_cap, cells_of, judge_cell, search_cost, smallest
from kvevict.stats.tolerance import judge_accuracy

TOP = 120  # the oracle's context: budgets are searched below it


def oracle(threshold: int, shaky: dict[int, set[int]] | None = None):
    """Scores by rule: the full cache answers every sample; a configuration answers sample i at budget b when
    b >= threshold, except the samples `shaky[b]` names; below the threshold it answers none."""
    shaky = shaky or {}

    def score(policy: str, budget, sample: int) -> float:
        if budget is None:
            return 1.0
        return float(budget >= threshold and sample not in shaky.get(budget, set()))

    return score


def fake_run_grid(score, asked: list):
    """`run_grid` answering by `score`: the full cache and every row at every budget, each sample not `done`."""

    def run(model, tokenizer, grid, done, on_records, limit=None, on_skip=None):
        lines = []
        for sample in range(grid.samples):
            for policy, budget in [("full", None), *((p, b) for p in grid.policies for b in grid.budgets)]:
                key = record_key(grid.protocol, grid.form, grid.tasks[0], grid.lengths[0], sample, policy,
                                 budget_label(budget), 0)
                if key in done:
                    continue
                asked.append((policy, budget, sample))
                lines.append({"key": key, "task": grid.tasks[0], "protocol": grid.protocol,
                              "length": grid.lengths[0], "sample": sample, "policy": policy,
                              "budget": budget_label(budget), "score": score(policy, budget, sample),
                              "seconds": 0.5})
        on_records(lines)
        return lines

    return run


@pytest.fixture
def with_oracle(monkeypatch):
    def use(score):
        asked: list = []
        monkeypatch.setattr(task_envelope, "run_grid", fake_run_grid(score, asked))
        monkeypatch.setattr(task_envelope, "context_top", lambda config, tokenizer, limit: TOP)
        monkeypatch.setattr(task_envelope, "max_positions", lambda model: None)
        return asked

    return use


def config(tmp_path, **overrides) -> TaskEnvelopeConfig:
    base = dict(policies=["window"], floor=8, resolution=1.0001, start=40, cap=120, out=str(tmp_path / "runs"),
                name="t", length=256)
    base.update(overrides)
    return TaskEnvelopeConfig(**base)


def judged(cfg: TaskEnvelopeConfig, records: list) -> dict:
    return cells_of(cfg.looks(), cfg.tolerance(), "window", records)


def test_looks_and_their_correction():
    cfg = TaskEnvelopeConfig(start=20, cap=60)
    assert cfg.looks() == [20, 40, 60]
    assert cfg.tolerance().confidence == pytest.approx(1 - 0.05 / 3)
    assert TaskEnvelopeConfig(start=25, cap=60).looks() == [25, 50, 60]


@pytest.mark.parametrize("threshold", [8, 37, 119])
def test_search_equals_a_brute_force_grid(tmp_path, with_oracle, threshold):
    """Every budget from the floor up judged at the cap by the rule: the smallest inside is the search's answer,
    found with far fewer answers than the grid's."""
    asked = with_oracle(oracle(threshold))
    cfg = config(tmp_path)
    _, records = run_task_envelope(cfg, model=None, tokenizer=None)
    score, n = oracle(threshold), cfg.cap
    full = [score("full", None, i) for i in range(n)]
    grid = {b: judge_accuracy([score("window", b, i) for i in range(n)], full, cfg.tolerance()).outcome == "inside"
            for b in range(cfg.floor, TOP)}
    best, failing = smallest(judged(cfg, records))
    assert best.budget == min(b for b, ok in grid.items() if ok) == threshold
    assert (failing is None) == (threshold == cfg.floor)
    assert len(asked) < n * (TOP - cfg.floor) / 10  # a search, not the grid
    # a cell that misses every answer is decided at the first look; one that misses none, at the first look where
    # that many agreeing answers bound the drop within the tolerance (80 here: 40 leave it about 8 points wide)
    agreeing = next(m for m in cfg.looks() if judge_accuracy([1.0] * m, [1.0] * m, cfg.tolerance()).outcome
                    == "inside")
    assert agreeing == 80
    cells = judged(cfg, records).values()
    assert {c.judgement.n for c in cells if c.judgement.outcome == "outside"} <= {cfg.start}
    assert {c.judgement.n for c in cells if c.judgement.outcome == "inside"} == {agreeing}


def test_a_cell_adds_samples_until_it_decides(tmp_path, with_oracle):
    """At budget 40 the configuration misses samples 3 and 7 (2 of the first 20: undecided), and nothing
    after: the cell takes more looks, and its judgement is the rule's at the last look taken."""
    asked = with_oracle(oracle(40, shaky={40: {3, 7}}))
    cfg = config(tmp_path, floor=40)  # the floor is probed first
    _, records = run_task_envelope(cfg, model=None, tokenizer=None)
    at_40 = sorted(s for p, b, s in asked if p == "window" and b == 40)
    expected = None
    for n in cfg.looks():  # the rule applied look by look
        hits = [0.0 if i in (3, 7) else 1.0 for i in range(n)]
        expected = judge_accuracy(hits, [1.0] * n, cfg.tolerance())
        if expected.outcome != "undecided":
            break
    assert at_40 == list(range(expected.n))
    assert expected.n > cfg.start  # the precondition: the first look did not decide
    cell = judged(cfg, records)[40]
    assert (cell.judgement.n, cell.judgement.outcome) == (expected.n, expected.outcome)


def test_a_cell_stops_at_the_look_that_decides_it():
    """Answers stored beyond the deciding look (a fixed grid's, in the same folder) are not read: 80 of 80 at
    the first look is inside; the 80 misses after it would put the cell outside at the cap."""
    cfg = TaskEnvelopeConfig(start=80, cap=160)
    answered = {i: float(i < 80) for i in range(160)}
    full = dict.fromkeys(range(160), 1.0)
    at_cap_only = judge_accuracy(list(answered.values()), list(full.values()), cfg.tolerance())
    assert at_cap_only.outcome == "outside"  # the precondition: judged on all 60 it would fail
    cell = judge_cell(cfg.looks(), cfg.tolerance(), "window", 100, answered, full)
    assert (cell.judgement.n, cell.judgement.outcome, cell.need) == (80, "inside", None)


def test_a_cell_undecided_at_the_cap_counts_as_not_inside(tmp_path, with_oracle):
    """From budget 20 up the configuration misses one sample in 20 (2 of the first 40, 4 of 80, 6 of 120): its
    drop sits on the 5-point limit, no look decides, so every such cell reaches the cap undecided, and nothing is
    shown inside."""
    shaky = {b: {3, 7, 50, 70, 90, 110} for b in range(8, TOP)}
    with_oracle(oracle(20, shaky=shaky))
    cfg = config(tmp_path)
    _, records = run_task_envelope(cfg, model=None, tokenizer=None)
    capped = at_cap(judged(cfg, records))
    assert capped and all(c.judgement.n == cfg.cap for c in capped)
    assert smallest(judged(cfg, records))[0] is None


def test_interrupted_search_resumes_without_recomputing(tmp_path, with_oracle):
    asked = with_oracle(oracle(37))
    cfg = config(tmp_path)
    _, whole = run_task_envelope(cfg, model=None, tokenizer=None)
    first = len(asked)
    _, again = run_task_envelope(cfg, model=None, tokenizer=None)
    assert len(asked) == first  # nothing answered twice
    assert search_cost(again) == search_cost(whole)


def test_on_a_tiny_model_every_cell_is_answered_on_the_full_caches_samples(tmp_path, tiny_dir):
    """The real grid runner: each probed cell's samples are ones the full cache answered too, records are
    `RulerRecord`s, and a rerun answers nothing new."""
    from kvevict import load_model
    from kvevict.records.schema import RulerRecord

    model, tokenizer = load_model(str(tiny_dir))
    # 4 agreeing answers can show 60 points at 97.5%: the search may end inside
    cfg = config(tmp_path, length=400, start=2, cap=4, floor=16, resolution=2.0, max_accuracy_drop=0.6,
                 max_new_tokens=4)
    store, records = run_task_envelope(cfg, model, tokenizer)
    answers = [r for r in records if isinstance(r, RulerRecord)]
    full = {r.sample for r in answers if r.policy == "full"}
    assert answers and {r.sample for r in answers if r.policy != "full"} <= full
    before = store.records()
    run_task_envelope(cfg, model, tokenizer)
    assert store.records() == before


def test_kvzip_reconstructs_each_context_once_for_the_whole_search(tmp_path, tiny_dir, monkeypatch):
    """A policy scored by reconstruction keeps each context's scores in the run folder: every later step that
    answers the same sample at another budget reads them back instead of running the repeat forwards again.
    The full cache answers nothing on a tiny random model, so every ratio is undecided and each cell runs to the
    cap: the search takes several steps over the same samples."""
    from kvevict import load_model
    from kvevict.records.schema import RulerRecord

    from support import count_repeat_forwards

    passes = count_repeat_forwards(monkeypatch)
    model, tokenizer = load_model(str(tiny_dir))
    cfg = config(tmp_path, policies=["kvzip"], length=400, start=2, cap=2, floor=16, resolution=3.0,
                 min_accuracy_ratio=0.1, max_new_tokens=2)
    _, records = run_task_envelope(cfg, model, tokenizer)
    answers = [r for r in records if isinstance(r, RulerRecord) and r.policy != "full"]
    budgets = {r.budget for r in answers}
    assert len(budgets) > 1  # more than one step over the same samples
    assert len(passes) == len({r.sample for r in answers}) == 2  # one repeat forward (one chunk) a context
    assert len(list((tmp_path / "runs" / "t" / "reconstruction").glob("*.pt"))) == 2


def test_the_answer_cap_reaches_every_answer_and_is_part_of_the_folders_experiment(tmp_path, tiny_dir,
                                                                                   monkeypatch):
    """`--max-new-tokens` caps each answer the search generates (RULER's own length for niah_single_1 is far
    longer), and a folder of capped answers refuses a rerun at another cap: its cells would mix both."""
    from kvevict import load_model
    from kvevict.errors import KvevictError
    from kvevict.eval.ruler import protocols
    from kvevict.eval.ruler.registry import get_task

    limits, real = [], protocols.greedy
    monkeypatch.setattr(protocols, "greedy", lambda model, state, limit, *rest, **kw: (
        limits.append(limit), real(model, state, limit, *rest, **kw))[1])
    model, tokenizer = load_model(str(tiny_dir))
    cfg = config(tmp_path, length=400, start=2, cap=2, floor=16, resolution=3.0, min_accuracy_ratio=0.1,
                 max_new_tokens=3)
    run_task_envelope(cfg, model, tokenizer)
    assert limits and set(limits) == {3} and get_task("niah_single_1").tokens_to_generate > 3
    with pytest.raises(KvevictError, match="use another --name"):
        run_task_envelope(config(tmp_path, length=400, start=2, cap=2, floor=16, resolution=3.0,
                                 min_accuracy_ratio=0.1), model, tokenizer)


def test_cli_prints_the_table_the_verdict_and_the_cost(tmp_path, tiny_dir):
    from support import cli

    result = cli("envelope", "--model", str(tiny_dir), "--tasks", "niah_single_1", "--lengths", "400", "--policies",
                 "window", "--floor", "16", "--resolution", "2", "--samples-start", "2", "--samples-max", "4",
                 "--max-accuracy-drop", "0.6", "--max-new-tokens", "4", "--out", str(tmp_path / "runs"), "--name", "t",
                 env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.stderr
    assert "smallest inside" in result.stdout and "niah_single_1 at 400 tokens" in result.stdout
    answers = len((tmp_path / "runs" / "t" / "results.jsonl").read_text().splitlines())
    assert f"cost: {answers} answers" in result.stdout


@pytest.mark.parametrize("args,needle", [
    (["--samples-start", "0"], "give 1 <= start <= max"),
    (["--samples-start", "30", "--samples-max", "20"], "give 1 <= start <= max"),
    # 30 agreeing answers bound the drop from about 11 points at the looks' 98.3%: 5 points cannot be shown
    (["--samples-start", "10", "--samples-max", "30", "--policies", "full"], "raise --samples-max to at least 76"),
    (["--tasks", "no_such_task"], "no_such_task"),
    (["--policies", "full"], "never evicts"),
    (["--max-new-tokens", "-1"], "--max-new-tokens must be 0 (RULER's answer length) or positive, got -1"),
])
def test_bad_task_envelope_input_is_one_line(args, needle):
    from support import cli_error

    base = {"--tasks": "niah_single_1", "--policies": "window"}
    given = dict(zip(args[::2], args[1::2]))
    argv = [x for k, v in {**base, **given}.items() for x in (k, v)]
    cli_error("envelope", *argv, needles=(needle,))


def test_the_table_and_verdict_show_bytes_and_rank_by_them():
    """Two configurations inside: h2o at 100 entries holding 1,000 bytes a sample, q8+h2o at 150 entries holding
    600; the full cache holds 4,000. The cheapest is the one with fewer bytes, at 15.0% of the full cache's."""
    from kvevict.records.schema import RulerRecord
    from kvevict.report.task_envelope import task_envelope_table, task_rows, task_verdict

    def line(policy: str, budget: str, sample: int, size: int) -> RulerRecord:
        return RulerRecord(key=f"{policy}|{budget}|{sample}", task="niah_single_1", protocol="agnostic", length=256,
                           sample=sample, policy=policy, budget=budget, score=1.0, kv_bytes_bf16=size)

    records = [line(p, b, i, size) for p, b, size in [("full", "full", 4000), ("h2o", "100", 1000),
                                                      ("q8+h2o", "150", 600)] for i in range(80)]
    cfg = TaskEnvelopeConfig(start=80, cap=160)
    rows = task_rows(["h2o", "q8+h2o"], {}, cfg.looks(), cfg.tolerance(), records, 200)
    assert [r.smallest.budget for r in rows] == [100, 150]
    sentence = task_verdict(rows, cfg.tolerance(), "niah_single_1", 256)
    assert "(fewest KV bytes) is q8+h2o at 150 entries" in sentence and "15.0% of the full cache's bytes" in sentence
    table = task_envelope_table(rows)
    column = table.headers.index("of full (bytes)")
    assert [r[column] for r in table.rows] == ["25.0%", "15.0%"]
    # without byte figures (records written before them) the fewest entries decide
    bare = [RulerRecord(**{**vars(r), "kv_bytes_bf16": None}) for r in records]
    rows = task_rows(["h2o", "q8+h2o"], {}, cfg.looks(), cfg.tolerance(), bare, 200)
    assert "(fewest entries) is h2o at 100 entries" in task_verdict(rows, cfg.tolerance(), "niah_single_1", 256)
