"""Pass-key retrieval: prompts, grid bookkeeping, bad input, and the embedded model's behaviour."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from kvevict import KvevictError
from kvevict.cli import app
from kvevict.eval.needle import NeedleResult, PromptMaker, check_grid, run_needle
from kvevict.loading import load_tokenizer

from support import close
from support import one_line_error as _one_line_error

runner = CliRunner()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def maker(tokenizer):
    return PromptMaker(tokenizer, seed=3)


def one_line_error(result, *needles: str) -> None:
    _one_line_error(result.exit_code, result.stderr, *needles)


def test_prompt_holds_the_key_once_at_the_right_place(maker, tokenizer):
    for depth in (0.0, 0.25, 0.5, 0.9, 1.0):
        prompt = maker.make(400, depth, trial=1)
        text = tokenizer.decode(prompt.ids)
        sentence = f"The secret pass key is {prompt.key}."
        assert text.count(prompt.key) == 1 and sentence in text
        assert len(prompt.key) == 5 and prompt.key.isdigit()
        # the whole prompt: template opening, exactly `length` haystack tokens, question
        assert prompt.ids.numel() == 400 + maker.overhead()
        assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
        assert text.index(sentence) < text.index("What is the secret pass key?")
        # the needle sits where its token index says, and near the asked depth
        needle_text = tokenizer.decode(prompt.ids[prompt.needle_at : prompt.needle_at + 12])
        assert needle_text.strip().startswith("The secret pass key is")
        assert abs(prompt.needle_depth - depth) < 0.2
    assert maker.make(400, 0.0, 1).needle_depth == 0.0
    last = maker.make(400, 1.0, 1)
    assert last.needle_at + 12 >= last.split - 1  # at the very end of the haystack


def test_trials_are_seeded_and_paired_across_depths(maker, tokenizer):
    a, b = maker.make(300, 0.2, 0), maker.make(300, 0.8, 0)
    assert a.key == b.key  # same trial, same key and haystack: depths differ only by where the needle is
    strip = lambda p: tokenizer.decode(p.ids).replace(f" The secret pass key is {p.key}. ", "")  # noqa: E731
    assert strip(a).split() == strip(b).split()
    assert maker.make(300, 0.2, 1).key != a.key or strip(maker.make(300, 0.2, 1)) != strip(a)
    again = PromptMaker(maker.tokenizer, seed=3).make(300, 0.2, 0)
    assert again.key == a.key and bool((again.ids == a.ids).all())


def test_cells_aggregate_trials():
    records = [
        {"policy": "h2o", "budget": "25%", "length": 1000, "depth": 0.5, "hit": hit, "budget_tokens": 260}
        for hit in (True, False, True, True)
    ] + [{"policy": "full", "budget": "full", "length": 1000, "depth": 0.5, "hit": False, "budget_tokens": None}]
    cells = {(c["policy"], c["budget"]): c for c in NeedleResult(records).cells()}
    assert cells[("h2o", "25%")]["accuracy"] == 0.75 and cells[("h2o", "25%")]["trials"] == 4
    assert cells[("full", "full")]["accuracy"] == 0.0 and cells[("full", "full")]["trials"] == 1


@pytest.mark.parametrize("lengths,depths,trials,message", [
    ([1000], [1.5], 3, "outside [0, 1]"),
    ([1000], [-0.1], 3, "outside [0, 1]"),
    ([1000], [0.5], 0, "at least 1"),
    ([10], [0.5], 1, "too short"),
    ([], [0.5], 1, "no haystack lengths"),
])
def test_check_grid(lengths, depths, trials, message):
    with pytest.raises(KvevictError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_grid(lengths, depths, trials)


@pytest.mark.parametrize("args,needles", [
    (["--depths", "0.5,1.2"], ["depth 1.2 is outside [0, 1]"]),
    (["--trials", "0"], ["trials must be at least 1"]),
    (["--lengths", "1000,abc"], ["--lengths takes comma-separated ints"]),
    (["--budgets", "150%"], ["percentage in (0, 100]"]),
    (["--policies", "lru"], ["unknown policy 'lru'"]),
])
def test_cli_rejects_bad_grid_before_loading(args, needles):
    one_line_error(runner.invoke(app, ["needle", "--model", "/nonexistent", *args]), *needles)


def test_cli_length_above_context(tiny_dir):
    result = runner.invoke(app, ["needle", "--model", str(tiny_dir), "--lengths", "9000", "--policies", "full"])
    one_line_error(result, "haystack length 9000", "context of 8192")


def test_cli_budget_too_small_for_policy(tiny_dir):
    result = runner.invoke(app, ["needle", "--model", str(tiny_dir), "--lengths", "100", "--policies", "snapkv",
                                 "--budgets", "10%", "--trials", "1"])
    one_line_error(result, "budget 10%", "snapkv:window=32")


def test_cli_json_cells(tiny_dir):
    result = runner.invoke(app, ["needle", "--model", str(tiny_dir), "--lengths", "64", "--depths", "0,1",
                                 "--trials", "2", "--policies", "full,window,sink4+h2o", "--budgets", "50%,20",
                                 "--json"])
    assert result.exit_code == 0, result.output
    cells = json.loads(result.stdout.strip().splitlines()[-1])["cells"]
    # full once, the two bounded policies at each of the two budgets; 2 depths each
    assert len(cells) == (1 + 2 * 2) * 2
    for cell in cells:
        assert {"policy", "budget", "length", "depth", "accuracy", "trials"} <= set(cell)
        assert cell["trials"] == 2 and cell["length"] == 64 and cell["accuracy"] in (0.0, 0.5, 1.0)
    assert {c["budget"] for c in cells} == {"full", "50%", "20"}


def test_cli_without_chat_template_falls_back(tiny_dir, tmp_path):
    plain = tmp_path / "plain"
    shutil.copytree(tiny_dir, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in plain.glob("chat_template.*"):
        extra.unlink()
    result = runner.invoke(app, ["needle", "--model", str(plain), "--lengths", "64", "--depths", "0.5",
                                 "--trials", "1", "--policies", "full", "--json"])
    assert result.exit_code == 0, result.output
    assert "no chat template" in result.stderr and "plain" in result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["cells"][0]["trials"] == 1


@pytest.mark.model
def test_embedded_model_finds_the_key_with_full_cache_and_loses_it_when_evicted():
    from kvevict.loading import load_model

    model, tokenizer = load_model("smollm2-135m")
    # seed 0, trial 0 is a haystack the small model answers from (it misses about a third of them)
    result = run_needle(model, tokenizer, lengths=[500], depths=[0.1, 0.5], trials=1,
                        policies=["full", "window"], budgets=["20%"], progress=False)
    hits = {r["policy"]: [] for r in result.records}
    for r in result.records:
        hits[r["policy"]].append(r["hit"])
    assert sum(hits["full"]) == 2, result.records
    # a window of the last 20% cannot hold a needle at depth 0.1 or 0.5
    assert sum(hits["window"]) == 0, result.records


def test_heatmaps_one_figure_per_policy_one_panel_per_budget():
    import numpy as np

    from kvevict.report.plots import png
    from kvevict.report.task_plots import needle_heatmaps

    accuracy = {(1000, 0.1): 1.0, (2000, 0.1): 0.5, (1000, 0.9): 0.0, (2000, 0.9): 0.25}
    cells = [
        {"policy": p, "budget": b, "length": n, "depth": d, "accuracy": accuracy[(n, d)] / (2 if b == "10%" else 1),
         "trials": 2}
        for p, budgets in (("full", ["full"]), ("h2o", ["10%", "50%"]))
        for b in budgets for n in (1000, 2000) for d in (0.1, 0.9)
    ]
    figures = needle_heatmaps(cells)
    assert [title for title, _ in figures] == ["needle: full", "needle: h2o"]
    full, h2o = (fig for _, fig in figures)
    # budgets from the largest share down; each panel a depth x length grid of accuracies
    assert [ax.get_title() for ax in h2o.axes] == ["budget 50%", "budget 10%"]
    for ax, scale in zip(h2o.axes, (1, 2)):
        grid = np.asarray(ax.images[0].get_array())
        assert grid.tolist() == [[1.0 / scale, 0.5 / scale], [0.0, 0.25 / scale]]  # rows: depth 0.1, 0.9
        assert ax.get_xlabel() == "haystack tokens" and ax.get_ylabel() == "needle depth"
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1000", "2000"]
        assert [t.get_text() for t in ax.texts] == [f"{v:.2f}" for v in grid.flatten()]
    assert len(full.axes) == 1 and full.axes[0].get_title() == "budget full"
    assert png(full).startswith(b"\x89PNG")
    close(h2o)


def test_markdown_table_counts_hits():
    from kvevict.report.tables import needle_markdown

    cells = [
        {"policy": "h2o", "budget": "10%", "length": 1000, "depth": 0.1, "accuracy": 1 / 3, "trials": 3},
        {"policy": "h2o", "budget": "10%", "length": 1000, "depth": 0.9, "accuracy": 1.0, "trials": 3},
        {"policy": "h2o", "budget": "50%", "length": 1000, "depth": 0.1, "accuracy": 2 / 3, "trials": 3},
        {"policy": "full", "budget": "full", "length": 1000, "depth": 0.1, "accuracy": 1.0, "trials": 3},
    ]
    lines = needle_markdown(cells).splitlines()
    assert lines[0] == "| policy | budget | 1000 @ 0.1 | 1000 @ 0.9 | all |"
    assert lines[2:] == ["| full | full | 3/3 | - | 3/3 |", "| h2o | 50% | 2/3 | - | 2/3 |",
                         "| h2o | 10% | 1/3 | 3/3 | 4/6 |"]


def test_each_trial_records_the_kv_bytes_its_cache_held_and_the_grid_shows_them(tiny_dir):
    """A tiny Llama (2 layers x 2 KV heads x head_dim 16, float32): a row compressed to 25% holds that many entries
    per layer and head, keys and values, 2 bytes each at bf16; the full cache holds the whole compressed prompt.
    The grid's last column is their mean over trials, in MiB, one figure per length."""
    from kvevict.loading import load_model
    from kvevict.report.tables import needle_grid

    model, tok = load_model(str(tiny_dir))
    result = run_needle(model, tok, lengths=[200, 300], depths=[0.5], trials=2, policies=["full", "window"],
                        budgets=["25%"], max_new_tokens=2, progress=False)
    per_token = 2 * 2 * 2 * 16  # layers x KV heads x (key, value) x head_dim
    for r in result.records:
        held = r["prompt_tokens"] - 1 if r["policy"] == "full" else r["budget_tokens"]  # the last token is read after
        assert (r["kv_bytes"], r["kv_bytes_bf16"]) == (per_token * held * 4, per_token * held * 2), r
    table = needle_grid(result.cells())
    assert table.headers[-1] == "KV MiB/seq bf16"
    window = next(row for row in table.rows if row[0] == "window")
    expected = [sum(r["kv_bytes_bf16"] for r in result.records if r["policy"] == "window" and r["length"] == n) / 2
                for n in (200, 300)]
    assert window[-1] == " / ".join(f"{b / 2**20:.4g}" for b in expected)
