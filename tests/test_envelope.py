"""`kvevict envelope`: the bisection against a brute-force grid of every budget, resume, the report."""

from __future__ import annotations

import random

import pytest
import torch

from kvevict.ab import worker as ab_worker
from kvevict.ab.bisection import Bracket, step
from kvevict.ab.envelope import EnvelopeConfig, run_envelope
from kvevict.data import load_tokens
from kvevict.eval.streaming import compare, full_reference
from kvevict.records.schema import PplRecord, load, ppl_records
from kvevict.records.store import ResultStore
from kvevict.report.envelope import envelope_rows, envelope_verdict
from kvevict.report.envelope_page import render_envelope
from kvevict.report.envelope_plot import envelope_figure, pareto
from kvevict.stats.tolerance import Tolerance, judge_ppl
from kvevict.stats.uncertainty import blocks

from conftest import make_tiny
from support import cli, cli_error

TEXT = "It was the best of times, it was the worst of times, it was the age of wisdom. " * 40
SEED, TOKENS, FLOOR, RATIO = 3, 128, 8, 1.2
#: configurations whose grid of every budget is an up-set at this tolerance (checked below as a precondition)
POLICIES = ["window", "sink1+window", "h2o", "streamingllm"]


class CharTokenizer:
    """Characters mod the tiny vocabulary."""

    def __call__(self, text, add_special_tokens=False, return_tensors="pt"):
        return {"input_ids": torch.tensor([[ord(c) % 101 for c in text]])}


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    return path


def config(tmp_path, text_file, **overrides) -> EnvelopeConfig:
    base = dict(text=str(text_file), tokens=TOKENS, policies=POLICIES, floor=FLOOR, resolution=1.0001,
                max_ppl_ratio=RATIO, out=str(tmp_path / "runs"), name="e")
    base.update(overrides)
    return EnvelopeConfig(**base)


def _record(result, budget) -> PplRecord:
    """A probe's record from a row of `compare`, its blocks the same 40 windows a sweep records."""
    width = max(1, result.nll.numel() // 40)
    return PplRecord(key=f"{budget}", kind="policy" if budget else "full", policy=result.policy, budget=budget,
                     ppl=result.ppl, nll_mean=result.nll_mean, curve=result.ppl_windows(width))


def grid(model, text_file, policy: str) -> dict[int, bool]:
    """Every budget from the floor to the length, each run on its own and judged by the rule: budget -> inside."""
    tokens, _ = load_tokens(str(text_file), CharTokenizer(), TOKENS)
    reference = full_reference(model, tokens, progress=False)
    full = _record(reference.result, None)
    out = {}
    for budget in range(FLOOR, TOKENS):
        rows, _ = compare(model, tokens, [policy], budget, reference=reference, progress=False)
        out[budget] = judge_ppl(blocks(_record(rows[0], budget).curve, "ppl"), blocks(full.curve, "ppl"),
                                Tolerance(max_ppl_ratio=RATIO)).outcome == "inside"
    return out


@pytest.mark.parametrize("threshold", [5, 17, 64, 127, None])
@pytest.mark.parametrize("resolution", [1.0001, 1.1, 1.5])
def test_bisection_finds_the_threshold_of_a_monotone_predicate(threshold, resolution):
    """A hand-made monotone predicate: the search ends on a passing budget within `resolution` of a failing
    one (neighbours at the finest), the floor when the floor passes, none when nothing below the length does."""
    bracket = Bracket(4, 128, resolution)
    probed: dict[int, bool] = {}
    while (found := step(bracket, probed)).next is not None:
        assert found.next not in probed
        probed[found.next] = threshold is not None and found.next >= threshold
    if threshold is None:
        assert found.smallest is None and found.failing == max(probed)
    elif threshold <= 4:
        assert found.smallest == 4 and found.failing is None
    else:
        assert found.smallest >= threshold and not probed[found.failing]
        assert found.smallest / found.failing <= resolution or found.smallest - found.failing == 1
        if resolution < 1.01:
            assert found.smallest == threshold
    assert len(probed) <= 12


def test_bisection_probes_few_budgets():
    """Exact to the token below 128 from a floor of 4: about log2(124) probes, not 124."""
    rng = random.Random(0)
    for _ in range(50):
        threshold = rng.randrange(5, 128)
        probed: dict[int, bool] = {}
        while (found := step(Bracket(4, 128, 1.0001), probed)).next is not None:
            probed[found.next] = found.next >= threshold
        assert found.smallest == threshold
        # the floor, then ~log2(124) halvings (in log budget, so the top of the range takes a few more)
        assert len(probed) <= 10


def test_search_equals_a_brute_force_grid(tmp_path, text_file):
    """On a tiny model the search's answer for every configuration is the smallest budget a grid of every
    budget judges inside (the grid computed independently: each budget on its own stream)."""
    model = make_tiny(seed=SEED)
    _, records = run_envelope(config(tmp_path, text_file), model=model, tokenizer=CharTokenizer(), progress=False)
    full, rows = envelope_rows(records, Tolerance(max_ppl_ratio=RATIO))
    found = {row.spec: row for row in rows}
    for policy in POLICIES:
        passing = grid(model, text_file, policy)
        inside = [b for b, ok in passing.items() if ok]
        assert inside == list(range(min(inside), TOKENS)), f"precondition: {policy}'s grid is not monotone"
        row = found[parse_spec(policy)]
        assert row.smallest.budget == min(inside)
        assert row.failing.budget == min(inside) - 1
        assert len(row.probes) < 12  # a search, not the grid


def parse_spec(label: str) -> str:
    from kvevict.ab.plan import canonical

    return canonical(label, 0)


def test_interrupted_search_resumes_without_recomputing(tmp_path, text_file, monkeypatch):
    """Killed after two batches, a rerun finishes the search with the same answer as an uninterrupted one,
    and no probe is measured twice."""
    model = make_tiny(seed=SEED)
    _, whole = run_envelope(config(tmp_path, text_file, name="whole"), model=model, tokenizer=CharTokenizer(),
                            progress=False)
    seen = []

    def stop_after_two(batch):
        if len(seen) == 2:
            raise KeyboardInterrupt
        seen.append(batch)

    cfg = config(tmp_path, text_file, name="cut")
    with pytest.raises(KeyboardInterrupt):
        run_envelope(cfg, model=model, tokenizer=CharTokenizer(), progress=False, on_batch=stop_after_two)
    first = {r["key"] for r in ResultStore(cfg.sweep().folder / "results.jsonl").records()}
    assert first and "full|full|None" in first
    measured = []
    real = ab_worker.compare
    monkeypatch.setattr(ab_worker, "compare",
                        lambda m, t, specs, budget, *a, **k: measured.extend((s, budget) for s in specs)
                        or real(m, t, specs, budget, *a, **k))
    store, again = run_envelope(cfg, model=model, tokenizer=CharTokenizer(), progress=False)
    assert measured  # the rerun finished what the first run left
    keys = [r["key"] for r in store.records()]
    assert len(keys) == len(set(keys))  # nothing measured twice
    assert not {f"policy|{s}|{b}" for s, b in measured} & first
    tolerance = Tolerance(max_ppl_ratio=RATIO)
    answer = {r.spec: (r.smallest and r.smallest.budget) for r in envelope_rows(again, tolerance)[1]}
    assert answer == {r.spec: (r.smallest and r.smallest.budget) for r in envelope_rows(whole, tolerance)[1]}
    # a third run measures nothing at all, and needs no model
    monkeypatch.setattr(ab_worker, "compare", lambda *a, **k: pytest.fail("a finished search measured again"))
    run_envelope(cfg, model=None, tokenizer=None, progress=False)


def test_report_page_table_figure_and_verdict(tmp_path, text_file):
    """The page holds the verdict, the table and the figure; the figure draws every probe and the front."""
    model = make_tiny(seed=SEED)
    cfg = config(tmp_path, text_file, resolution=1.3)
    store, records = run_envelope(cfg, model=model, tokenizer=CharTokenizer(), progress=False)
    tolerance = cfg.tolerance()
    full, rows = envelope_rows(records, tolerance)
    sentence = envelope_verdict(full, rows, tolerance)
    cheapest = min((r for r in rows if r.smallest), key=lambda r: r.smallest.record.kv_bytes)
    assert f"the cheapest configuration is {cheapest.name} at {cheapest.smallest.budget} entries" in sentence
    # bytes actually held: a full-attention layer of the tiny Llama holds the budget per KV head, 2 x 16 x 4 bytes
    p = cheapest.smallest
    assert p.record.kv_bytes == 2 * 2 * p.budget * (2 * 16 * 4)
    assert p.record.full_kv_bytes == 2 * 2 * TOKENS * (2 * 16 * 4)
    fig = envelope_figure(full, rows, RATIO)
    ax = fig.axes[0]
    assert sum(len(c.get_children()) > 0 for c in ax.containers) == sum(len(r.probes) for r in rows)
    assert [line.get_ydata()[0] for line in ax.get_lines() if line.get_label().startswith("tolerance")] == [RATIO]
    page = render_envelope(vars(cfg), full, rows, tolerance, tmp_path / "e.html").read_text()
    assert 'id="envelope"' in page and "data:image/png" in page and cheapest.name in page


def test_pareto_front_by_hand():
    points = [(10, 3.0), (20, 2.0), (15, 4.0), (30, 2.5), (40, 1.0), (5, 9.0)]
    assert pareto(points) == [(5, 9.0), (10, 3.0), (20, 2.0), (40, 1.0)]


def test_lengths_run_one_search_per_length(tmp_path, tiny_dir):
    """`--lengths`: one run folder per length, and the cross-length table gives each folder's own answer."""
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    result = cli("envelope", "--model", str(tiny_dir), "--text", str(text), "--lengths", "96,128", "--policies",
                 "window", "--floor", "8", "--resolution", "1.5", "--max-ppl-ratio", "1.5",
                 "--out", str(tmp_path / "runs"), "--name", "l", env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.stderr
    line = [x for x in result.stdout.splitlines() if x.startswith("│ window")][-1]  # the cross-length table
    cells = [c.strip() for c in line.strip("│ ").split("│")]
    for length, cell in zip((96, 128), cells[1:]):
        records = ppl_records(load(ResultStore(tmp_path / "runs" / f"l-{length}" / "results.jsonl").records()))
        (row,) = envelope_rows(records, Tolerance(max_ppl_ratio=1.5))[1]
        assert cell.split()[0] == (str(row.smallest.budget) if row.smallest else "none")


@pytest.mark.parametrize("lengths,needle", [("2X", "--lengths takes token counts"), ("1", "at least 2 tokens"),
                                            ("64,128", "--floor 64 is not below")])
def test_bad_lengths(lengths, needle):
    cli_error("envelope", "--lengths", lengths, "--floor", "64", needles=(needle,))


def test_dtype_is_the_one_loaded_and_the_bytes_are_counted_in_it(tmp_path, tiny_dir):
    """`--dtype bfloat16` loads the model in bf16: every probe records it, and the bytes are what the tensors
    hold, 2 bytes per element: the full cache layers x 2 (K, V) x KV heads x head_dim x 96 tokens x 2, the
    floor's window 8 of those 96 entries."""
    import json

    from transformers import AutoConfig

    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    config = AutoConfig.from_pretrained(tiny_dir)
    elements = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 96
    for dtype, width in (("float32", 4), ("bfloat16", 2)):
        result = cli("envelope", "--model", str(tiny_dir), "--text", str(text), "--tokens", "96", "--policies",
                     "window", "--floor", "8", "--resolution", "1.5", "--max-ppl-ratio", "1.5", "--dtype", dtype,
                     "--out", str(tmp_path / "runs"), "--name", dtype, env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.stderr
        lines = [json.loads(x) for x in (tmp_path / "runs" / dtype / "results.jsonl").read_text().splitlines()]
        assert {line["dtype"] for line in lines} == {dtype}
        probes = [line for line in lines if line["kind"] == "policy"]
        assert {line["full_kv_bytes"] for line in probes} == {elements * width}
        floor = next(line for line in probes if line["budget"] == 8)  # a window of 8 holds 8 entries
        assert floor["kv_bytes"] == elements * width * 8 // 96


def test_bits_are_searched_like_any_configuration(tmp_path, text_file):
    """A quantized configuration is searched as any other: its smallest budget is the one a grid of every
    budget judges inside, and its probes hold the bytes its codes take. Worked by hand for the tiny model
    (float32, head_dim 16, `q4:group=8`): per entry and KV head, codes 2 x 16 x 4 bits = 16 bytes, and a
    scale and a zero point per group of 8 for keys and for values, 2 x 2 x 2 x 4 bytes = 32: 48 bytes,
    against 2 x 16 x 4 = 128 unquantized. Both searches start at the floor, where they hold as many entries."""
    model = make_tiny(seed=SEED)
    quantized = "q4:group=8+streamingllm"
    _, records = run_envelope(config(tmp_path, text_file, policies=[quantized, "streamingllm"]), model=model,
                              tokenizer=CharTokenizer(), progress=False)
    full, rows = envelope_rows(records, Tolerance(max_ppl_ratio=RATIO))
    row = {r.spec: r for r in rows}[parse_spec(quantized)]
    passing = grid(model, text_file, quantized)
    inside = [b for b, ok in passing.items() if ok]
    assert inside == list(range(min(inside), TOKENS)), "precondition: the quantized grid is not monotone"
    assert row.smallest.budget == min(inside)
    at_floor = {r.policy: r.kv_bytes for r in records if r.kind == "policy" and r.budget == FLOOR}
    assert at_floor[parse_spec(quantized)] * 128 == at_floor[parse_spec("streamingllm")] * 48
    # at bf16 every float is 2 bytes: codes 16 bytes, scales and zero points 2 x 2 x 2 x 2 = 16: 32 of 64, so the
    # share the verdict ranks by is half the unquantized cache's, not the 48/128 held in float32
    probe = next(p for p in row.probes if p.budget == FLOOR)
    plain = next(p for r in rows if r.spec == parse_spec("streamingllm") for p in r.probes if p.budget == FLOOR)
    assert probe.share_bf16 * 64 == pytest.approx(plain.share_bf16 * 32)
    assert probe.share * 128 == pytest.approx(plain.share * 48)


def test_the_default_search_runs_every_default_policy(tmp_path):
    """`kvevict envelope` with no options: every default policy is accepted at the default floor (SnapKV's window
    of 32 needs a budget above it), checked before any model loads."""
    from kvevict.ab.envelope import EnvelopeConfig, configurations

    default = EnvelopeConfig(out=str(tmp_path))
    assert "snapkv" in default.policies
    assert len(configurations(default)) == len(default.policies)


def _synthetic(kind: str, budget: int | None, ppls: list[float]) -> PplRecord:
    """A record whose curve is `ppls`, one 50-token window each, and byte counts that make shares defined."""
    curve = [{"start": 50 * i + 1, "end": 50 * (i + 1), "n": 50, "ppl": p} for i, p in enumerate(ppls)]
    return PplRecord(key=f"{kind}|{budget}", kind=kind, policy="full" if kind == "full" else "window", budget=budget,
                     ppl=float(sum(ppls) / len(ppls)), curve=curve, kv_bytes=100 * (budget or 40 * 50),
                     full_kv_bytes=100 * 40 * 50)


def test_verdict_is_undecided_where_the_full_cache_is_the_worse_model():
    """A stream past the trained positions: the full cache's blocks (PPL near 80) are every one worse than the
    policy's (near 20), so being within 5% of it shows nothing safe and the verdict says undecided. The same
    probe a little worse than a sound full cache is named as the cheapest."""
    rng = random.Random(0)
    noise = [rng.uniform(0.9, 1.1) for _ in range(40)]
    tolerance = Tolerance(max_ppl_ratio=1.05)
    degraded = _synthetic("full", None, [80 * x for x in noise])
    probe = _synthetic("policy", 64, [20 * x * rng.uniform(1.0, 1.04) for x in noise])
    full, rows = envelope_rows([degraded, probe], tolerance)
    assert rows[0].smallest is not None  # the rule alone would call it inside: ratio about 0.25
    sentence = envelope_verdict(full, rows, tolerance)
    assert sentence.startswith("Undecided: the full cache is not a sound reference")
    assert "window at 64 entries" in sentence and "cheapest" not in sentence
    sound = _synthetic("full", None, [20 * x for x in noise])
    full, rows = envelope_rows([sound, probe], tolerance)
    assert "the cheapest configuration is window at 64 entries" in envelope_verdict(full, rows, tolerance)
