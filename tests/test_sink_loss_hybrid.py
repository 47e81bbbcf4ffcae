"""One sink-loss figure on a hybrid model (sliding + full layers): the JSON row, the summary table, the side-by-side
table and the verdict all agree with one count made by hand from the model's config; the oracle is refused there."""

from __future__ import annotations

import json

import pytest
import torch

from architectures import BUILDERS, GEMMA_WINDOW
from kvevict.ab import SweepConfig, run_sweep
from kvevict.errors import KvevictError
from kvevict.records.schema import PplRecord
from kvevict.report.compare import compare_table
from kvevict.report.runs import load_run
from kvevict.report.tables import summary_table
from kvevict.report.verdict import verdict
from kvevict.report.verdict_text import markdown

from test_ab import TEXT, CharTokenizer


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory):
    torch.manual_seed(0)
    model = BUILDERS["gemma3"]().eval()
    folder = tmp_path_factory.mktemp("hybrid")
    text = folder / "t.txt"
    text.write_text(TEXT)
    config = SweepConfig(text=str(text), tokens=60, budgets=[12], policies=["window", "sink4+window"],
                         oracle_stride=0, out=str(folder), name="hybrid")
    run_sweep(config, model=model, tokenizer=CharTokenizer(), progress=False)
    return model, config


def hand_count(model) -> tuple[int, int]:
    """(full-attention layers, KV heads), read off the config: the pairs the budget bounds."""
    config = model.config
    return config.layer_types.count("full_attention"), config.num_key_value_heads


def test_every_view_of_sink_loss_shows_the_same_hand_count(hybrid_run):
    model, config = hybrid_run
    full_layers, heads = hand_count(model)
    bounded = full_layers * heads  # 2 x 2: the sliding layers (2 of 4) are not counted
    assert bounded == 4 and len(model.config.layer_types) == 4
    lines = [json.loads(line) for line in (config.folder / "results.jsonl").read_text().splitlines()]
    rows = {line["policy"]: line for line in lines if line["kind"] == "policy"}
    # a 12-entry window over 60 tokens evicts token 0 from every bounded (layer, head); sink4+window never does
    expected = {"window": (bounded, 1.0), "sink4+window": (0, 0.0)}
    for policy, (lost, share) in expected.items():
        line = rows[policy]
        assert line["sink_loss"] == share  # the JSON
        grid = line["sink_lost_at"]
        assert [layer is None for layer in grid] == [k == "sliding_attention" for k in model.config.layer_types]
        assert sum(at >= 0 for layer in grid if layer for at in layer) == lost
        assert line["sliding_window"] == GEMMA_WINDOW
    run = load_run(config.folder)
    table = summary_table([r for r in run.records if isinstance(r, PplRecord)])
    column = table.headers.index("sink loss")
    shown = {row[0]: row[column] for row in table.rows}
    assert shown["window"] == "1.00" and shown["sink4+window"] == "0.00"
    side = compare_table([run], ["m"])
    column = side.headers.index("m sink loss")
    assert {row[0]: row[column] for row in side.rows if row[0] != "full"} == {"window": "1.00",
                                                                             "sink4+window": "0.00"}
    found = verdict(run.records)[0]
    assert [(c.name, c.heads_lost, c.heads) for c in found.lost_sink] == [("window", bounded, bounded)]
    text = markdown([found])
    assert f"window on {bounded} of {bounded} heads" in text
    assert f"sliding layers (2): the model's window {GEMMA_WINDOW}" in text


def test_the_oracle_is_refused_on_a_hybrid_model_before_any_batch(tmp_path):
    model = BUILDERS["gemma3"]().eval()
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    config = SweepConfig(text=str(text), tokens=60, budgets=[12], policies=["window"], oracle_stride=8,
                         out=str(tmp_path), name="oracle")
    with pytest.raises(KvevictError, match="--oracle-stride 8 .*not defined on this hybrid model.*"
                                           "leave --oracle-stride out"):
        run_sweep(config, model=model, tokenizer=CharTokenizer(), progress=False)
    assert not (config.folder / "results.jsonl").exists() or not (config.folder / "results.jsonl").read_text()
