"""Generation failure modes: the metrics, the seeded prompts, the runner and the CLI."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvevict.cli import app
from kvevict.eval.generation import GenPromptMaker, repetition_rate, run_generation
from kvevict.loading import load_model, load_tokenizer

from support import cli_error

runner = CliRunner()


def test_repetition_rate_counts_repeated_ngrams():
    # 4-grams: 1234 2341 3412 4123 1234 2341 -> 6 grams, 4 distinct: 2 of 6 are repeats
    assert repetition_rate([1, 2, 3, 4, 1, 2, 3, 4, 1]) == pytest.approx(2 / 6)
    assert repetition_rate([7] * 10) == pytest.approx(6 / 7)
    assert repetition_rate(list(range(20))) == 0.0
    assert repetition_rate([1, 2, 3]) == 0.0
    assert repetition_rate([1, 2, 1, 2, 1], n=2) == pytest.approx(2 / 4)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


@pytest.mark.parametrize("chat", [True, False])
def test_prompt_states_the_fact_first_and_asks_last(tokenizer, chat):
    maker = GenPromptMaker(tokenizer, seed=1, chat=chat)
    for trial in range(4):
        prompt = maker.make(300, trial)
        text = tokenizer.decode(prompt.ids)
        fact = f"of {'the lighthouse keeper' if prompt.kind == 'name' else 'the locker'} is {prompt.answer}."
        assert text.count(prompt.answer) == 1 and fact in text  # stated once ...
        assert text.index(fact) < 150  # ... in the first sentence
        assert f"What is the {prompt.kind} of" in text[-120:]  # and asked at the end
        if chat:
            assert text.endswith("<|im_start|>assistant\n")
        else:
            assert text.endswith(" is") and "<|im_start|>" not in text
    kinds = {maker.make(300, t).kind for t in range(2)}
    assert kinds == {"name", "number"}
    again = GenPromptMaker(tokenizer, seed=1, chat=chat).make(300, 2)
    assert bool((again.ids == maker.make(300, 2).ids).all())


def test_runner_records(tiny_dir):
    model, tokenizer = load_model(str(tiny_dir))
    result = run_generation(model, tokenizer, ["full", "window", "streamingllm"], ["25%", 40], length=80, trials=2,
                            max_new_tokens=12, progress=False)
    # full once per prompt, the two bounded policies at two budgets
    assert len(result.records) == 2 * (1 + 2 * 2)
    for trial in range(2):
        sizes = {r["prompt_tokens"] for r in result.records if r["trial"] == trial}
        assert len(sizes) == 1  # every policy read the same prompt
    for r in result.records:
        assert r["output_tokens"] <= 12
        assert r["recalled"] == (r["expected"].lower() in r["output"].lower())
        assert 0.0 <= r["repetition"] <= 1.0
    rows = {(r["policy"], r["budget"]): r for r in result.summary()}
    assert set(rows) == {("full", "full"), ("window", "25%"), ("window", "40"), ("streamingllm", "25%"),
                         ("streamingllm", "40")}
    assert rows[("window", "40")]["trials"] == 2
    mine = [r["repetition"] for r in result.records if r["policy"] == "window" and r["budget"] == "40"]
    assert rows[("window", "40")]["repetition"] == pytest.approx(sum(mine) / 2)
    json.dumps(result.to_dict())


def test_cli_json_and_bad_input(tiny_dir):
    result = runner.invoke(app, ["generation", "--model", str(tiny_dir), "--length", "60", "--trials", "1",
                                 "--policies", "full,streamingllm", "--budgets", "50%", "--max-new-tokens", "6",
                                 "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout.strip().splitlines()[-1])["rows"]
    assert [r["policy"] for r in rows] == ["full", "streamingllm"]
    cli_error("generation", "--model", str(tiny_dir), "--trials", "0", needles=("at least 1",))
    cli_error("generation", "--model", str(tiny_dir), "--length", "9000", "--trials", "1", needles=("context of 8192",))


@pytest.mark.model
def test_embedded_model_recalls_the_start_only_with_the_full_cache():
    model, tokenizer = load_model("smollm2-135m")
    result = run_generation(model, tokenizer, ["full", "window", "streamingllm"], ["10%"], length=400, trials=2,
                            max_new_tokens=32, progress=False)
    recalled = {}
    for r in result.records:
        recalled.setdefault(r["policy"], []).append(r["recalled"])
    assert recalled["full"] == [True, True], result.records
    # the fact is in the first sentence: a window (with or without sinks) of 10% cannot hold it
    assert not any(recalled["window"]) and not any(recalled["streamingllm"]), result.records


def test_figure_and_table():
    from kvevict.report.plots import png
    from kvevict.report.tables import generation_table
    from kvevict.report.task_plots import generation_figure

    rows = [{"policy": "full", "budget": "full", "repetition": 0.0, "recall": 1.0, "output_tokens": 9.0, "trials": 4},
            {"policy": "window", "budget": "25%", "repetition": 0.6, "recall": 0.25, "output_tokens": 48.0,
             "trials": 4}]
    fig = generation_figure(rows)
    repetition, recall = fig.axes
    assert [bar.get_height() for bar in repetition.patches] == [0.0, 0.6]
    assert [bar.get_height() for bar in recall.patches] == [1.0, 0.25]
    for ax in (repetition, recall):
        assert [t.get_text() for t in ax.get_xticklabels()] == ["full\nfull", "window\n25%"]
        assert ax.get_ylim() == (0, 1)
    assert "repeated 4-grams" in repetition.get_title() and "recall" in recall.get_title()
    assert png(fig).startswith(b"\x89PNG")
    table = generation_table(rows)
    assert table.headers == ["policy", "budget", "repetition", "recall", "output tokens", "trials"]
    assert table.rows[1] == ["window", "25%", "0.600", "0.25", "48.0", "4"]
