"""The A/B harness: numbers against independent computations, resume, and SIGKILL safety."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict

import pytest
import torch

from kvevict.ab import SweepConfig, plan, prepare_folder, run_sweep
from kvevict.ab import worker as ab_worker
from kvevict.errors import KvevictError
from kvevict.records.schema import PplRecord
from kvevict.report.html import render

from conftest import make_tiny
from support import attn, band_sink_nll, cli


class CharTokenizer:
    """Characters mod the tiny vocabulary: enough to stream real text through a tiny model."""

    def __call__(self, text, add_special_tokens=False, return_tensors="pt"):
        return {"input_ids": torch.tensor([[ord(c) % 101 for c in text]])}


TEXT = "It was the best of times, it was the worst of times, it was the age of wisdom. " * 40


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    return path


def config(tmp_path, text_file, **overrides) -> SweepConfig:
    base = dict(text=str(text_file), tokens=260, budgets=[16, 32], policies=["window", "h2o", "snapkv:window=4"],
                sinks=[0, 2], oracle_stride=5, out=str(tmp_path / "runs"), name="t")
    base.update(overrides)
    return SweepConfig(**base)


def test_sweep_numbers_match_independent_forwards(tmp_path, text_file):
    model = make_tiny(seed=21)
    cfg = config(tmp_path, text_file)
    _, records = run_sweep(cfg, model=model, tokenizer=CharTokenizer(), progress=False)
    by_key = {r.key: r for r in records}
    tokens = CharTokenizer()(TEXT)["input_ids"][0][:260]
    with attn(model, "sdpa"), torch.inference_mode():
        full_logits = model(tokens[None]).logits[0].float()
    full_lp = torch.log_softmax(full_logits, -1)[:-1]
    full_nll = -full_lp.gather(-1, tokens[1:, None])[:, 0]
    assert all(isinstance(r, PplRecord) for r in records)
    assert math.isclose(by_key["full|full|None"].ppl, math.exp(full_nll.double().mean()), rel_tol=1e-4)
    # window: KL and PPL against the band-mask forward (an independent computation of the same cache)
    for budget in (16, 32):
        with attn(model, "sdpa"), torch.inference_mode():
            n = tokens.numel()
            i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
            visible = (j <= i) & (i - j <= budget)
            band = torch.log_softmax(model(tokens[None], attention_mask=visible[None, None]).logits[0].float(), -1)[:-1]
        kl = (full_lp.exp() * (full_lp - band)).sum(-1).double().mean()
        row = by_key[f"policy|window|{budget}"]
        assert math.isclose(row.kl_to_full, float(kl), rel_tol=1e-3, abs_tol=1e-5)
        band_nll = band_sink_nll(model, tokens, budget, 0)
        assert math.isclose(row.ppl, math.exp(band_nll.double().mean()), rel_tol=1e-4)
        # oracle: a fresh forward over exactly the previous `budget` tokens, every 5th token
        scored = list(range(budget, n - 1, 5))
        with attn(model, "sdpa"), torch.inference_mode():
            direct = [
                -torch.log_softmax(model(tokens[None, p + 1 - budget : p + 1]).logits[0, -1].float(), -1)[tokens[p + 1]]
                for p in scored
            ]
        # stratified: the head (all scored) exactly, the strided tail's mean for the whole tail
        head, tail = full_nll[:budget].double(), torch.stack(direct).double()
        expected = (head.sum() + tail.mean() * (n - 1 - budget)) / (n - 1)
        assert math.isclose(by_key[f"oracle|oracle|{budget}"].ppl, math.exp(expected), rel_tol=1e-4)
    assert by_key["sinks|window|16"].ppl == by_key["policy|window|16"].ppl
    assert by_key["sinks|sink2+window|32"].sink_loss == 0.0


def test_rerun_skips_finished_cells_and_finishes_the_rest(tmp_path, text_file, monkeypatch):
    model = make_tiny(seed=22)
    cfg = config(tmp_path, text_file)
    store, first = run_sweep(cfg, model=model, tokenizer=CharTokenizer(), progress=False)
    before = store.path.read_text()

    def boom(*args, **kwargs):
        raise AssertionError("a finished cell was recomputed")

    monkeypatch.setattr(ab_worker, "compare", boom)
    monkeypatch.setattr(ab_worker, "recompute_oracle", boom)
    _, again = run_sweep(cfg, model=model, tokenizer=CharTokenizer(), progress=False)
    assert store.path.read_text() == before
    assert sorted(r.key for r in again) == sorted(r.key for r in first)
    monkeypatch.undo()
    # drop the budget-32 rows: only they are recomputed, and give the same numbers
    lines = [line for line in before.splitlines() if '"budget": 32' not in line]
    store.path.write_text("\n".join(lines) + "\n")
    calls = []
    real = ab_worker.compare
    monkeypatch.setattr(ab_worker, "compare", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    _, third = run_sweep(cfg, model=model, tokenizer=CharTokenizer(), progress=False)
    assert calls == [32]
    old = {r.key: r.ppl for r in first}
    assert all(math.isclose(r.ppl, old[r.key], rel_tol=1e-6) for r in third)


def test_plan_rejects_bad_sweeps(tmp_path, text_file):
    with pytest.raises(KvevictError, match="unknown policy"):
        plan(config(tmp_path, text_file, policies=["window", "lru"]))
    with pytest.raises(KvevictError, match="empty"):
        plan(config(tmp_path, text_file, budgets=[]))
    with pytest.raises(KvevictError, match="not smaller than the 260 tokens"):
        plan(config(tmp_path, text_file, budgets=[16, 400]))
    with pytest.raises(KvevictError, match="pinned sinks"):
        plan(config(tmp_path, text_file, policies=["window"], budgets=[4], sinks=[8]))
    with pytest.raises(KvevictError, match="pinned sinks"):
        plan(config(tmp_path, text_file, policies=["sink16+h2o"], budgets=[16, 32]))
    with pytest.raises(KvevictError, match="budgets must be positive"):
        plan(config(tmp_path, text_file, policies=["full"], budgets=[0]))
    # `full` runs once, whatever the budgets: it is not a cell of any budget
    assert [c.key for c in plan(config(tmp_path, text_file, policies=["full"], sinks=[], budgets=[16]))] == [
        "full|full|None", "oracle|oracle|16"]


@pytest.mark.parametrize("name", ["../../somewhere", "a/b", "..", ".", "", "x\\y", "/abs"])
def test_run_name_is_one_folder_name(tmp_path, text_file, name):
    out = tmp_path / "runs"
    with pytest.raises(KvevictError, match="must be one folder name"):
        plan(config(tmp_path, text_file, out=str(out), name=name))
    with pytest.raises(KvevictError, match="must be one folder name"):
        prepare_folder(config(tmp_path, text_file, out=str(out), name=name))
    assert not out.exists() and not (tmp_path.parent / "somewhere").exists()


def test_run_folder_that_resolves_outside_out_is_refused(tmp_path, text_file):
    out, elsewhere = tmp_path / "runs", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "linked").symlink_to(elsewhere)
    with pytest.raises(KvevictError, match="outside --out"):
        prepare_folder(config(tmp_path, text_file, out=str(out), name="linked"))
    assert list(elsewhere.iterdir()) == []
    assert prepare_folder(config(tmp_path, text_file, out=str(out), name="fine")).path.parent == out / "fine"


def test_unwritable_output_folder(tmp_path, text_file):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(KvevictError, match="writable --out"):
        prepare_folder(config(tmp_path, text_file, out=str(blocker)))


def test_other_experiment_in_same_folder_is_refused(tmp_path, text_file):
    prepare_folder(config(tmp_path, text_file))
    with pytest.raises(KvevictError, match="another --name"):
        prepare_folder(config(tmp_path, text_file, tokens=300))


def test_report_has_every_table_and_plot(tmp_path, text_file):
    model = make_tiny(seed=23)
    cfg = config(tmp_path, text_file)
    _, records = run_sweep(cfg, model=model, tokenizer=CharTokenizer(), progress=False)
    page = render(records, asdict(cfg), tmp_path / "report.html").read_text()
    assert 'id="summary"' in page and 'id="sinks"' in page
    assert page.count("data:image/png;base64,") == 4  # position, budget, sinks, sink-loss heatmaps


def _run_cli(args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "kvevict.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def test_sigkill_mid_sweep_loses_nothing(tmp_path, tiny_dir):
    text_file = tmp_path / "long.txt"
    text_file.write_text(TEXT * 4)
    args = ["ab", "--model", str(tiny_dir), "--text", str(text_file), "--tokens", "600",
            "--budgets", "8,16,24", "--policies", "window,streamingllm,h2o", "--oracle-stride", "50",
            "--out", str(tmp_path / "runs"), "--name", "kill"]
    results = tmp_path / "runs" / "kill" / "results.jsonl"
    proc = _run_cli(args)
    deadline = time.time() + 300
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1]
        if results.exists() and len(results.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    time.sleep(0.5)  # well inside the next cell
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    survived = results.read_text()
    lines = survived.splitlines()
    assert 3 <= len(lines) < 1 + 3 * (1 + 3)  # killed mid-sweep: some cells written, not all
    for line in lines:
        json.loads(line)  # no corrupt line
    rerun = cli(*args)  # the resume in this process: only the kill needs a process of its own
    assert rerun.exit_code == 0, rerun.stderr
    stdout = rerun.stdout
    final = results.read_text()
    assert final.startswith(survived)  # finished cells kept bit-identical
    keys = [json.loads(line)["key"] for line in final.splitlines()]
    assert len(keys) == len(set(keys)) == 1 + 3 * (1 + 3)  # full; per budget the oracle and 3 policies
    report = stdout.strip().splitlines()[-1]
    assert report.endswith("report.html") and os.path.exists(report)


def _numbers(records):
    return {r.key: (r.ppl, r.kl_to_full, r.seed) for r in records}


def test_same_seed_same_results_and_seed_recorded(tmp_path, text_file):
    model = make_tiny(seed=24)
    runs = []
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        cfg = config(tmp_path, text_file, policies=["random", "sink2+random", "random:seed=7"], sinks=[],
                     budgets=[16], seed=seed, name=name)
        runs.append(_numbers(run_sweep(cfg, model=model, tokenizer=CharTokenizer(), progress=False)[1]))
    assert runs[0] == runs[1]
    assert all(seed == 3 for _, _, seed in runs[0].values())
    assert "policy|random:seed=3|16" in runs[0] and "policy|random:seed=4|16" in runs[2]
    # the sweep's seed reaches a seeded policy inside a sink wrapper; a seed the user wrote is kept
    assert "policy|sink2+random:seed=3|16" in runs[0] and "policy|sink2+random:seed=4|16" in runs[2]
    assert "policy|random:seed=7|16" in runs[0] and "policy|random:seed=7|16" in runs[2]
    assert runs[0]["policy|random:seed=7|16"][0] == runs[2]["policy|random:seed=7|16"][0]
    assert runs[0]["policy|random:seed=3|16"][0] != runs[2]["policy|random:seed=4|16"][0]


def test_ab_with_needle_generation_and_sink_map_sections(tmp_path, tiny_dir):
    from kvevict.loading import load_model

    model, tokenizer = load_model(str(tiny_dir))
    cfg = SweepConfig(tokens=300, budgets=[32], policies=["streamingllm", "h2o"], oracle_stride=50,
                      out=str(tmp_path / "runs"), name="extras", needle=[200], needle_depths=[0.5], needle_trials=1,
                      generation=True, generation_length=120, sink_map=True)
    store, records = run_sweep(cfg, model=model, tokenizer=tokenizer, progress=False)
    kinds = [r.kind for r in records]
    # full + streamingllm + h2o: one needle record each (one depth, one trial), four generation prompts each
    assert kinds.count("needle") == 3 and kinds.count("generation") == 3 * 4 and kinds.count("sinkmap") == 1
    for r in records:
        if r.kind == "needle":
            assert r.fields["hit"] == (r.fields["passkey"] in r.fields["answer"]) and len(r.fields["passkey"]) == 5
            assert r.key.startswith("needle|") and r.seed == 0
    page = render(records, asdict(cfg), tmp_path / "report.html").read_text()
    for table_id in ('id="summary"', 'id="needle"', 'id="generation"'):
        assert table_id in page
    assert "Attention-sink map" in page
    before = store.path.read_text()
    run_sweep(cfg, model=model, tokenizer=tokenizer, progress=False)  # finished protocols are not rerun
    assert store.path.read_text() == before


def test_per_layer_policy_runs_in_its_own_batch_and_reports_its_layer_budgets(tmp_path, text_file):
    """pyramidkv beside uniform policies: each row equals the same policy streamed alone,
    and the report shows the pyramid's budget per layer."""
    from kvevict.eval.streaming import compare
    from kvevict.report.sections import layer_budgets

    model = make_tiny(seed=21)
    spec = "pyramidkv:window=4,beta=2"
    cfg = config(tmp_path, text_file, budgets=[16], policies=["window", spec, "tova"], sinks=[])
    _, records = run_sweep(cfg, model=model, tokenizer=CharTokenizer(), progress=False)
    tokens = CharTokenizer()(TEXT)["input_ids"][0][:260]
    by_name = {r.name: r for r in records if r.kind == "policy"}
    for name in ("window", spec, "tova"):
        alone, _ = compare(model, tokens, [name], 16, reference=False, progress=False)
        assert math.isclose(by_name[name].ppl, alone[0].ppl, rel_tol=1e-5), name
    # window 4, 12 selectable on average: 12/2 = 6 at the top, 18 at the bottom (2 layers)
    assert by_name[spec].layer_budgets == [22, 10]
    assert by_name["window"].layer_budgets is None
    title, body = layer_budgets(records)
    assert title == "Budget per layer" and ">22</td>" in body and ">10</td>" in body and ">L1</th>" in body
