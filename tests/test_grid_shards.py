"""RULER grids shared out by sample (`ab.grid_shards`), checked in this process: an executor that answers each
one-sample shard on a worker of its own (a fresh model copy, as a Ray worker would hold), in reverse order, must
store the records a local run stores, resume what is missing, and steer the task envelope to the same answer.
The same runs on Ray workers are in test_ray_tasks.py (marker ray_cluster)."""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, replace

import pytest

from kvevict.ab.executors import Executor
from kvevict.ab.grid_shards import GridSpec, Shard, shard
from kvevict.ab.ruler import RulerRun, run_ruler
from kvevict.ab.task_envelope import TaskEnvelopeConfig, run_task_envelope
from kvevict.eval.ruler.grid import RulerGrid, record_key
from kvevict.policies.budget import budget_label
from kvevict.report.task_envelope import cells_of, smallest
from test_task_envelope import oracle, with_oracle  # noqa: F401 - with_oracle is a fixture

from support import cli_error

#: what an answer is: every field but the time it took
TIMING = ("seconds",)


@dataclass
class Scattered(Executor):
    """Each shard on a worker built for it alone from the portable spec (its own model load), the last first."""

    in_process: bool = False
    openings: int = 0
    shards: int = 0

    @contextmanager
    def opened(self):
        self.openings += 1
        yield

    def run(self, spec, todo, finished, progress) -> None:
        for item in reversed(todo):
            self.shards += 1
            lines = spec.portable().build().run(item)
            if isinstance(item, Shard):  # a shard answers its sample alone (a perplexity batch is no shard)
                assert {line["sample"] for line in lines} <= set(item.grid.only)
            finished(lines)


def answers(path) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == len({r["key"] for r in rows})  # nothing stored twice
    return {r["key"]: {k: v for k, v in r.items() if k not in TIMING} for r in rows}


def grid() -> RulerGrid:
    return RulerGrid(tasks=["niah_single_1", "niah_multikey_1"], lengths=[400], samples=3,
                     policies=["window", "h2o"], budgets=["50%", "25%"], max_new_tokens=4)


def test_a_shard_is_one_sample_of_every_task_length_and_budget():
    found = shard(grid(), {"k"})
    assert [s.grid.only for s in found] == [(0,), (1,), (2,)]
    assert all(replace(s.grid, only=None) == grid() and s.done == {"k"} for s in found)


def test_ruler_sharded_stores_the_local_runs_records_and_resumes(tmp_path, tiny_dir):
    from kvevict import load_model

    model, tokenizer = load_model(str(tiny_dir))
    two = replace(grid(), samples=2)  # two shards are enough to scatter and reorder; each costs a model load
    local = RulerRun("local", str(tmp_path), str(tiny_dir), two)
    run_ruler(local, model, tokenizer, progress=False)
    executor = Scattered()
    sharded = RulerRun("sharded", str(tmp_path), str(tiny_dir), two)
    run_ruler(sharded, model, tokenizer, progress=False, executor=executor)
    expected = answers(local.folder / "results.jsonl")
    assert len(expected) == 2 * 2 * 5 and answers(sharded.folder / "results.jsonl") == expected
    assert (executor.openings, executor.shards) == (1, 2)
    # a run cut short: the rerun answers the missing ones, the rest untouched
    results = sharded.folder / "results.jsonl"
    kept = results.read_text().splitlines()[:11]
    results.write_text("\n".join(kept) + "\n")
    run_ruler(sharded, model, tokenizer, progress=False, executor=Scattered())
    assert results.read_text().splitlines()[:11] == kept and answers(results) == expected


def test_the_task_envelope_on_shards_takes_the_local_searchs_steps(tmp_path, tiny_dir):
    """Through the real grid runner: the same steps and the same answers as the local search."""
    from kvevict import load_model

    model, tokenizer = load_model(str(tiny_dir))
    base = dict(model=str(tiny_dir), length=400, policies=["window", "h2o"], start=2, cap=4, floor=16,
                resolution=2.0, max_accuracy_drop=0.6, out=str(tmp_path / "runs"), max_new_tokens=4)
    steps: dict[str, list] = {"local": [], "sharded": []}
    run_task_envelope(TaskEnvelopeConfig(**base, name="local"), model, tokenizer, on_step=steps["local"].append)
    executor = Scattered()
    run_task_envelope(TaskEnvelopeConfig(**base, name="sharded"), model, tokenizer,
                      on_step=steps["sharded"].append, executor=executor)
    assert steps["sharded"] == steps["local"]
    assert answers(tmp_path / "runs" / "sharded" / "results.jsonl") == answers(
        tmp_path / "runs" / "local" / "results.jsonl")
    assert executor.openings == 1  # opened once for the whole search (Ray starts once)


def test_a_spec_travels_without_the_drivers_model(tiny_dir):
    spec = GridSpec(str(tiny_dir), "float32", loaded=object(), tokenizer=object())
    assert spec.portable().loaded is None and spec.portable().tokenizer is None


def test_the_perplexity_envelope_runs_each_steps_budgets_on_the_executor(tmp_path, tiny_dir):
    """The budgets of each step as batches on workers of their own (each computing the full-cache reference
    itself), the full cache's record here: the same probes and numbers as the local search."""
    from kvevict.ab.envelope import EnvelopeConfig, run_envelope
    from test_ray import NUMBERS, TEXT

    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    base = dict(model=str(tiny_dir), text=str(text), tokens=128, policies=["window", "h2o"], floor=8,
                resolution=1.5, max_ppl_ratio=1.001, out=str(tmp_path / "runs"))
    seen: dict[str, list] = {"local": [], "sharded": []}
    run_envelope(EnvelopeConfig(**base, name="local"), progress=False, on_batch=lambda b: seen["local"].append(
        (b.kind, b.budget)))
    executor = Scattered()
    run_envelope(EnvelopeConfig(**base, name="sharded"), progress=False, executor=executor,
                 on_batch=lambda b: seen["sharded"].append((b.kind, b.budget)))

    def numbers(name: str) -> dict:
        rows = [json.loads(line) for line in (tmp_path / "runs" / name / "results.jsonl").read_text().splitlines()]
        return {r["key"]: {k: r.get(k) for k in NUMBERS} for r in rows}

    assert seen["sharded"] == seen["local"] and len(seen["local"]) > 3
    assert numbers("sharded") == numbers("local")
    assert executor.shards == len(seen["local"]) - 1 and executor.openings == 1  # all but the full cache's


@pytest.mark.parametrize("command", [["ruler"], ["envelope"], ["envelope", "--tasks", "niah_single_1"]])
@pytest.mark.parametrize("args, needle", [
    (["--executor", "dask"], "--executor must be one of local, ray, got 'dask'"),
    (["--address", "127.0.0.1:6379"], "--address is for --executor ray"),
    (["--executor", "ray", "--workers", "0"], "--workers must be at least 1"),
])
def test_a_bad_executor_is_one_line_before_any_model_work(tmp_path, command, args, needle):
    cli_error(*command, *args, "--out", str(tmp_path), needles=(needle,))


def shard_oracle(score):
    """`run_grid` answering a shard by `score` (test_task_envelope's oracle): its samples only."""

    def run(model, tokenizer, grid, done, on_records=None, limit=None, on_skip=None):
        lines = []
        for sample in grid.only if grid.only is not None else range(grid.samples):
            for policy, budget in [("full", None), *((p, b) for p in grid.policies for b in grid.budgets)]:
                key = record_key(grid.protocol, grid.form, grid.tasks[0], grid.lengths[0], sample, policy,
                                 budget_label(budget), 0)
                if key not in done:
                    lines.append({"key": key, "task": grid.tasks[0], "protocol": grid.protocol,
                                  "length": grid.lengths[0], "sample": sample, "policy": policy,
                                  "budget": budget_label(budget), "score": score(policy, budget, sample)})
        return lines

    return run


def test_a_search_of_several_looks_and_budgets_on_shards_is_the_local_one(tmp_path, with_oracle, monkeypatch):  # noqa: F811
    """On an oracle whose cell at budget 40 misses 2 of its first 20 samples (undecided: more looks) and that
    passes from 40 up: the sharded search takes the local one's steps (several looks, several budgets), stores
    its answers once each, and finds the same smallest budget."""
    from kvevict import loading
    from kvevict.ab import grid_shards

    score = oracle(40, shaky={40: {3}})  # one answer lost at 40: 10 points, inside at the third look (60 answers)
    with_oracle(score)
    monkeypatch.setattr(grid_shards, "run_grid", shard_oracle(score))
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: (None, None))
    base = dict(policies=["window", "h2o"], floor=8, resolution=1.0001, start=20, cap=60, length=256,
                max_accuracy_drop=0.1, out=str(tmp_path / "runs"))
    steps: dict[str, list] = {"local": [], "sharded": []}
    cfg = {name: TaskEnvelopeConfig(**base, name=name) for name in steps}
    _, local = run_task_envelope(cfg["local"], None, None, on_step=steps["local"].append)
    _, sharded = run_task_envelope(cfg["sharded"], None, None, on_step=steps["sharded"].append,
                                   executor=Scattered())
    assert steps["sharded"] == steps["local"] and len(steps["local"]) > 4
    assert any(samples > 40 for step in steps["local"] for _, samples in step)  # a cell took the third look
    assert answers(tmp_path / "runs" / "sharded" / "results.jsonl").keys() == answers(
        tmp_path / "runs" / "local" / "results.jsonl").keys()
    found = {name: smallest(cells_of(cfg[name].looks(), cfg[name].tolerance(), "window", records))[0].budget
             for name, records in (("local", local), ("sharded", sharded))}
    assert found == {"local": 40, "sharded": 40}
