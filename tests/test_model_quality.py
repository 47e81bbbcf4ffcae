"""Claims about quality, checked on the embedded real model (SmolLM2-135M on pg-essays).

Small forms of the README measurements, so CI re-checks them on every run.
"""

from __future__ import annotations

import pytest
import torch

from kvevict import compare, load_model, load_text, load_tokens
from kvevict.data import tokenize

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def smollm():
    return load_model("smollm2-135m")


def test_embedded_model_and_text(smollm):
    model, tokenizer = smollm
    config = model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert next(model.parameters()).dtype == torch.float32
    text = load_text("pg-essays")
    assert text.count("\n\n") > 40
    assert 140_000 < tokenize(text, tokenizer).numel() < 170_000
    assert tokenizer.chat_template


def test_evicting_the_sink_costs_a_large_factor_and_pinning_recovers_it(smollm):
    model, tokenizer = smollm
    tokens, _ = load_tokens("pg-essays", tokenizer, 700)
    rows, full = compare(model, tokens, ["window", "sink4+window"], budget=64, progress=False)
    window, streaming = rows
    assert window.first_token_evicted and not streaming.first_token_evicted
    assert streaming.sink_loss == 0.0 and window.sink_loss == 1.0
    assert window.ppl > 1.5 * streaming.ppl, (window.ppl, streaming.ppl)
    assert streaming.ppl < 1.6 * full.ppl, (streaming.ppl, full.ppl)
    assert float(streaming.kl.mean()) < float(window.kl.mean())
